"""Malformed values under the job's prefix, written as an attacker (or a mistaken script)
with write access to it would, against a running two-node job.

Real etcd, real daemons, real torchrun and trainer. Every bad value must be ignored
with one warning naming its key: no daemon crashes or logs a traceback, training
keeps stepping, and the membership view and the prober still work afterwards (a
SIGKILLed node is found lost and the survivor steps on alone). A drain key that is
not JSON is, by design, still a drain request ("a drain key exists"): the node it
names drains gracefully, and nothing worse.
"""

from __future__ import annotations

import json
import time

import pytest

from elasticd.rendezvous.keys import JobKeys
from tests.daemon_nodes import DaemonNode, log_lines, nodes_and_client, stepping_at, stop_nodes, wait_for

ETCD_WARNING = "ignoring a malformed value in etcd; treating it as absent"
RECORD_WARNING = "ignoring a malformed node record"

BAD_RECORDS = {
    "zz": b"[]",
    "zy": json.dumps({"state": "running", "agent_pid": "abc", "probe": "x"}).encode(),
    "zx": b"\xff{not json",
}


@pytest.fixture
def cluster(job_id, etcd_server):
    with nodes_and_client(etcd_server.endpoint) as (nodes, client):
        yield nodes, client
        stop_nodes(nodes)
        keys = JobKeys(job_id)
        for key in (keys.state, keys.checkpoint_latest, keys.drain("a"), keys.node("a"),
                    keys.node("b"), *map(keys.node, BAD_RECORDS)):
            client.delete(key)


def _warnings(node: DaemonNode, event: str, key: str) -> list[dict]:
    return [e for e in log_lines(node) if e.get("event") == event and e.get("key") == key]


def _wait_warned(nodes: list[DaemonNode], event: str, key: str, count: int = 1) -> None:
    wait_for(lambda: all(len(_warnings(n, event, key)) >= count for n in nodes), 15,
             f"{count} warning(s) naming {key}", nodes)
    for node in nodes:
        assert node.running(), node.log_tail()


def _assert_no_traceback(node: DaemonNode) -> None:
    text = node.log_path.read_text(errors="replace")
    assert "Traceback" not in text, node.log_tail()
    bad = [e for e in log_lines(node) if "exception" in e or e.get("event") == "action failed"]
    assert not bad, bad


def _world_of_two(nodes: list, etcd_server, job_id: str, tmp_path, names: str = "ab"
                  ) -> list[DaemonNode]:
    size = len(names)
    for name in names:
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path,
                          {"min_nodes": 1, "max_nodes": size})
        nodes.append(node.start())
    wait_for(lambda: stepping_at(nodes, size, 0), 120, f"world of {size}", nodes)
    return nodes


@pytest.mark.slow
def test_malformed_values_are_ignored_and_the_job_goes_on(tmp_path, job_id, etcd_server, cluster):
    nodes, client = cluster
    keys = JobKeys(job_id)
    a, b = _world_of_two(nodes, etcd_server, job_id, tmp_path)

    # /state: not JSON, JSON but not an object, an object whose state is not a string.
    # Read once a second; each value is waited for, so none is overwritten unseen.
    for count, value in enumerate([b"completed", b"[1]", b'{"state": 1}'], start=1):
        client.put(keys.state, value)
        _wait_warned(nodes, ETCD_WARNING, keys.state, count)

    # Node records that are not JSON, not an object, or of the wrong types.
    for node_id, value in BAD_RECORDS.items():
        client.put(keys.node(node_id), value)
    for node_id in BAD_RECORDS:
        _wait_warned(nodes, RECORD_WARNING, f"nodes/{node_id}")
    problems = {e["key"]: e["problem"] for e in log_lines(a) if e.get("event") == RECORD_WARNING}
    assert "agent_pid" in problems["nodes/zy"], problems
    assert "not JSON" in problems["nodes/zx"], problems

    # A hint only the daemon writes and `elasticd status` reads: the daemon must not care.
    client.put(keys.checkpoint_latest, b"garbage")

    written = time.time()
    wait_for(lambda: stepping_at(nodes, 2, written + 3), 30, "steps after the malformed writes", nodes)
    for node in nodes:
        assert node.running(), node.log_tail()
        _assert_no_traceback(node)
        events = [e.get("event", "") for e in log_lines(node)]
        assert not [e for e in events if "job completed" in e or e.startswith("draining")], events

    # The membership view and the prober still work: a crash is found and handled.
    crashed = time.time()
    b.kill()
    wait_for(lambda: any(e.get("event", "").startswith("peer(s) b lost") for e in log_lines(a)), 30,
             "a to find b lost", nodes)
    wait_for(lambda: stepping_at([a], 1, crashed), 60, "a stepping alone", nodes)
    assert a.running(), a.log_tail()
    _assert_no_traceback(a)
    peers = [e for e in log_lines(a) if "peer(s) z" in e.get("event", "")]
    assert not peers, peers   # the malformed records were never taken for peers

    # A drain key that is not JSON: a drain request all the same, carried out gracefully.
    client.put(keys.drain("a"), b"garbage")
    assert a.proc.wait(timeout=60) == 0, a.log_tail()
    assert _warnings(a, ETCD_WARNING, keys.drain("a")), a.log_tail()
    events = [e.get("event", "") for e in log_lines(a)]
    assert any(e.startswith("draining because `elasticd drain` asked for it") for e in events), events
    assert "the agent stopped; leaving the job and exiting" in events
    assert client.get(keys.drain("a")) is None, "the drained node did not delete its drain key"
    _assert_no_traceback(a)


@pytest.mark.slow
def test_garbage_over_a_live_peers_record_does_not_hide_its_crash(tmp_path, job_id, etcd_server,
                                                                   cluster):
    # Three nodes: the garbage (on no lease) hides etcd's verdict, so the death is decided
    # by the survivors' majority (elasticd.quorum): in a world of two one vote is not one.
    nodes, client = cluster
    keys = JobKeys(job_id)
    a, b, _ = _world_of_two(nodes, etcd_server, job_id, tmp_path, names="abc")
    client.put(keys.node("b"), b"{broken")
    _wait_warned([a], RECORD_WARNING, "nodes/b")
    assert b.running(), b.log_tail()
    b.kill()
    # b's own lease TTL is 5 s; the refused probes alone should find it within a second or two.
    wait_for(lambda: any(e.get("event", "").startswith("peer(s) b lost") for e in log_lines(a)), 20,
             "a to find b lost", nodes)
    assert a.running(), a.log_tail()
    _assert_no_traceback(a)
