"""Membership, probes and the etcd adapter under the loop's rules, against a real etcd.

- a record update that fails while etcd is down is republished when it returns;
- the adapter hands out typed watch events and translated errors only;
- a healthy watch is never re-created; a broken one is, after a re-list;
- every etcd call inside ``deadline()`` ends by it, even against a frozen etcd;
- probes run concurrently and confirmations come back off the caller's thread;
- malformed node records are ignored, never raised.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest

from elasticd import proctree
from elasticd.errors import EtcdError, EtcdUnavailable
from elasticd.etcd_client import EtcdClient, EtcdSettings, WatchEvent, deadline
from elasticd.membership import Membership, parse_record
from elasticd.probe import Prober, ProbeServer
from elasticd.rendezvous.keys import JobKeys


def _client(etcd) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,), timeout_s=2.0, retry_s=2.0))


def _record(client: EtcdClient, keys: JobKeys, node: str) -> dict | None:
    kv = client.get(keys.node(node))
    return None if kv is None else json.loads(kv.value)


def _member(etcd, job_id: str, state: str) -> tuple[JobKeys, EtcdClient, Membership]:
    """Node a registered in a fresh job: its keys, client and membership."""
    keys = JobKeys(job_id)
    client = _client(etcd)
    member = Membership(client, keys, "a", 10, {"state": state})
    member.register()
    return keys, client, member


@pytest.mark.process
def test_a_lost_update_is_republished_when_etcd_returns(fresh_etcd, job_id):
    keys, client, member = _member(fresh_etcd, job_id, "starting")
    try:
        fresh_etcd.kill()
        with deadline(1.0):
            member.update(state="leaving")      # fails: etcd is down
        assert member.dirty
        fresh_etcd.start(timeout_s=60)
        assert proctree.wait_for(lambda: (member.poll(), not member.dirty)[1], 20)
        assert _record(client, keys, "a")["state"] == "leaving"
    finally:
        member.leave()
        client.close()


@pytest.mark.process
def test_the_adapter_yields_typed_watch_events(fresh_etcd, job_id):
    keys = JobKeys(job_id)
    client = _client(fresh_etcd)
    seen: list = []
    cancel = client.watch_prefix(keys.nodes, seen.append)
    try:
        client.put(keys.node("x"), b'{"state": "running"}')
        client.delete(keys.node("x"))
        assert proctree.wait_for(lambda: sum(len(b) for b in seen if isinstance(b, list)) >= 2, 10)
        events = [e for batch in seen for e in batch]
        assert all(isinstance(e, WatchEvent) for e in events)
        assert [(e.key, e.deleted) for e in events] == [(keys.node("x"), False), (keys.node("x"), True)]
        fresh_etcd.kill()
        assert proctree.wait_for(lambda: any(isinstance(b, EtcdError) for b in seen), 10)
    finally:
        cancel()
        client.close()


@pytest.mark.process
def test_a_healthy_watch_is_never_recreated_and_a_broken_one_is(fresh_etcd, job_id):
    keys, client, member = _member(fresh_etcd, job_id, "running")
    try:
        end = time.monotonic() + 7.0          # longer than the old 5 s re-list period
        while time.monotonic() < end:
            member.poll()
            time.sleep(0.1)
        assert member.resyncs == 1
        client.put(keys.node("b"), b'{"state": "running"}')
        assert proctree.wait_for(lambda: "b" in member.peers(), 5)
        fresh_etcd.restart(timeout_s=60)
        client.put(keys.node("c"), b'{"state": "running"}')
        assert proctree.wait_for(lambda: (member.poll(), "c" in member.peers())[1], 20)
        assert member.resyncs >= 2
    finally:
        member.leave()
        client.close()


@pytest.mark.process
def test_calls_inside_a_deadline_end_by_it_against_a_frozen_etcd(fresh_etcd, job_id):
    keys = JobKeys(job_id)
    client = EtcdClient(EtcdSettings(endpoints=(fresh_etcd.endpoint,), timeout_s=5.0, retry_s=30.0))
    client.put(keys.state, b"{}")
    os.kill(fresh_etcd.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with deadline(0.8), pytest.raises(EtcdUnavailable):
            client.get(keys.state)
        first = time.monotonic() - start
        with deadline(0.5), pytest.raises(EtcdUnavailable):
            time.sleep(0.6)
            client.put(keys.state, b"{}")      # the deadline already passed: fails at once
        total = time.monotonic() - start
    finally:
        os.kill(fresh_etcd.proc.pid, signal.SIGCONT)
    assert first < 1.5, f"a call under a 0.8 s deadline took {first:.2f} s"
    assert total - first < 1.0
    assert client.get(keys.state) is not None  # outside a deadline: the normal timeout again
    client.close()


def _silent_server() -> socket.socket:
    """Accepts connections (in the kernel backlog) and never answers: a stopped daemon."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.listen(16)
    return sock


class _Peer:
    def __init__(self, node_id: str, probe: str | None) -> None:
        self.node_id, self.probe = node_id, probe


@pytest.mark.process
def test_probes_run_concurrently_and_confirmations_come_back_later():
    silent = [_silent_server() for _ in range(4)]
    dead = socket.create_server(("127.0.0.1", 0))
    dead_endpoint = f"127.0.0.1:{dead.getsockname()[1]}"
    dead.close()                                  # nothing listens: refused
    alive = ProbeServer().start()
    peers = {f"s{i}": _Peer(f"s{i}", f"127.0.0.1:{s.getsockname()[1]}") for i, s in enumerate(silent)}
    peers["dead"] = _Peer("dead", dead_endpoint)
    prober = Prober(lambda: peers, interval_s=0.2, timeout_s=0.5).start()
    try:
        start = time.monotonic()
        assert proctree.wait_for(lambda: any(p.node_id == "dead" for p in prober.take_refused()), 5)
        # One round of 5 probes: concurrent, so about one timeout, not five.
        assert time.monotonic() - start < 1.5
        t0 = time.monotonic()
        prober.confirm("s0", peers["s0"].probe)
        prober.confirm("up", alive.endpoint)
        prober.confirm("gone", None)
        assert time.monotonic() - t0 < 0.1       # never blocks the caller
        answers: dict[str, str] = {}
        assert proctree.wait_for(lambda: (answers.update(prober.take_confirmations()),
                                          len(answers) == 3)[1], 3)
        assert answers == {"s0": "silent", "up": "alive", "gone": "refused"}
    finally:
        prober.stop()
        alive.stop()
        for s in silent:
            s.close()


@pytest.mark.parametrize("value", [b"[]", b"not json", b"42", b'{"state": 7}',
                                   b'{"state": "running", "agent_pid": "abc"}',
                                   b'{"state": "running", "agent_pid": true}',
                                   b'{"state": "running", "probe": "nowhere"}',
                                   b'{"state": "running", "addr": ["x"]}'])
def test_a_malformed_node_record_is_ignored(value):
    assert parse_record("zz", value, 3) is None


def test_a_well_formed_node_record_is_parsed():
    peer = parse_record("b", b'{"state": "running", "agent_pid": 7, "addr": "10.0.0.2", '
                             b'"probe": "10.0.0.2:4000"}', 3)
    assert peer.view().agent == ("10.0.0.2", 7) and peer.probe == "10.0.0.2:4000"
    assert parse_record("c", b"{}", 1).state == "starting"


@pytest.mark.process
def test_malformed_records_in_etcd_reach_neither_the_view_nor_the_prober(fresh_etcd, job_id):
    keys = JobKeys(job_id)
    client = _client(fresh_etcd)
    member = Membership(client, keys, "a", 10, {"state": "running"})
    client.put(keys.node("bad1"), b"[]")
    member.register()
    try:
        client.put(keys.node("bad2"), b'{"state": "running", "agent_pid": "abc"}')
        client.put(keys.node("good"), b'{"state": "running"}')
        assert proctree.wait_for(lambda: "good" in member.peers(), 5)
        assert set(member.peers()) == {"good"}
    finally:
        member.leave()
        client.close()
