"""The daemon's fenced edits of the live state (admin) and the backend's guard, on real etcd."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import datetime

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.rendezvous import admin
from elasticd.rendezvous.backend import CheckedBackend, EtcdV3RendezvousBackend
from elasticd.rendezvous.handler import create_handler
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.state_ops import CorruptStateError


def node(addr: str, pid: int) -> dyn._NodeDesc:
    return dyn._NodeDesc(addr, pid, 0)


def state(*nodes: dyn._NodeDesc, closed: bool = False, round_: int = 3) -> bytes:
    s = dyn._RendezvousState()
    s.round, s.complete, s.closed = round_, True, closed
    for rank, n in enumerate(nodes):
        s.participants[n] = rank
        s.last_heartbeats[n] = datetime.now()
    return pickle.dumps(s)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# -- reopen ------------------------------------------------------------------------------

def test_reopen_if_closed_reopens_once(client, keys):
    client.put(keys.rdzv_state, state(node("a", 1), closed=True))
    assert admin.reopen_if_closed(client, keys, deadline_s=2.0)
    s = pickle.loads(client.get(keys.rdzv_state).value)
    assert not s.closed and s.round == 3 and list(s.participants) == [node("a", 1)]
    assert not admin.reopen_if_closed(client, keys, deadline_s=2.0)   # open: nothing to do
    assert admin.current_round(client, keys).closed is False


def test_reopen_of_an_absent_state_is_a_no_op(client, keys):
    assert not admin.reopen_if_closed(client, keys, deadline_s=1.0)
    assert client.get(keys.rdzv_state) is None


def test_reopen_keeps_the_state_on_its_lease(client, keys):
    lease = client.grant_lease(60)
    client.put(keys.rdzv_state, state(closed=True), lease)
    assert admin.reopen_if_closed(client, keys, deadline_s=2.0)
    assert client.get(keys.rdzv_state).lease_id == lease
    client.revoke_lease(lease)


# -- bounded by time ---------------------------------------------------------------------

def _rewriter(client: EtcdClient, keys: JobKeys, value: bytes, stop: threading.Event) -> None:
    """An agent that rewrites the state all the time: every fenced write loses."""
    while not stop.is_set():
        client.put(keys.rdzv_state, value)


@pytest.mark.parametrize("op", ["evict", "reopen"])
def test_lost_races_are_retried_only_within_the_budget(client, keys, op):
    value = state(node("a", 1), node("b", 2), closed=True)
    client.put(keys.rdzv_state, value)
    stop = threading.Event()
    writers = [threading.Thread(target=_rewriter, args=(client, keys, value, stop)) for _ in range(3)]
    for w in writers:
        w.start()
    try:
        start = time.monotonic()
        if op == "evict":
            result = admin.evict_agents(client, keys, {("b", 2)}, 1, deadline_s=0.5)
            changed = bool(result.removed)
        else:
            changed = admin.reopen_if_closed(client, keys, deadline_s=0.5)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        for w in writers:
            w.join()
    # One read + one write past the budget at most; a win is possible but rare.
    assert elapsed < 1.5, f"{op} took {elapsed:.2f} s with a 0.5 s budget"
    assert changed in (True, False)


@pytest.mark.process
@pytest.mark.parametrize("op", ["evict", "reopen"])
def test_etcd_down_fails_fast_instead_of_retrying(fresh_etcd, job_id, op):
    """The client retries an outage for 30 s; the daemon's calls must not wait that out."""
    keys = JobKeys(job_id)
    client = EtcdClient(EtcdSettings(endpoints=(fresh_etcd.endpoint,), retry_s=30, timeout_s=1))
    try:
        client.put(keys.rdzv_state, state(node("a", 1), closed=True))
        fresh_etcd.stop()
        start = time.monotonic()
        with pytest.raises(EtcdError):
            if op == "evict":
                admin.evict_agents(client, keys, {("a", 1)}, 1, deadline_s=2.0)
            else:
                admin.reopen_if_closed(client, keys, deadline_s=2.0)
        assert time.monotonic() - start < 3.0
    finally:
        client.close()


def test_evict_without_a_race_still_works(client, keys):
    client.put(keys.rdzv_state, state(node("a", 1), node("b", 2)))
    removal = admin.evict_agents(client, keys, {("b", 2)}, 1)
    assert removal.removed == ("b_2_0",) and removal.in_round
    assert admin.current_round(client, keys).participants == (("a", 1),)


# -- a crafted value in the state key ----------------------------------------------------

def test_a_crafted_state_runs_no_code_in_the_daemon(client, keys, tmp_path):
    marker = tmp_path / "pwned"
    client.put(keys.rdzv_state, pickle.dumps(_Evil(str(marker))))
    for call in (lambda: admin.current_round(client, keys),
                 lambda: admin.evict_agents(client, keys, {("a", 1)}, 1),
                 lambda: admin.reopen_if_closed(client, keys)):
        # An EtcdError, so the daemon's existing handlers of etcd failures cover it.
        with pytest.raises(EtcdError, match=f"etcdctl del {keys.rdzv_state}"):
            call()
    assert not marker.exists()


def test_a_crafted_state_never_reaches_torch(client, keys, tmp_path, etcd_server):
    marker = tmp_path / "pwned"
    raw = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    backend = CheckedBackend(raw)
    _, token, _ = backend.set_state(state(node("a", 1)))
    evil = pickle.dumps(_Evil(str(marker)))
    client.put(keys.rdzv_state, evil)
    assert raw.get_state()[0] == evil     # torch's contract: the backend's bytes are opaque
    with pytest.raises(RendezvousStateError, match=f"rendezvous state at {keys.rdzv_state}.*etcdctl del"):
        backend.get_state()
    # A lost race hands torch the current value: checked too.
    with pytest.raises(CorruptStateError):
        backend.set_state(state(node("a", 1), round_=4), token)
    # The same through torch's own state holder, as the agent's handler syncs it.
    holder = dyn._BackendRendezvousStateHolder(
        backend, dyn.RendezvousSettings(keys.job_id, 1, 2, dyn.RendezvousTimeout(),
                                        __import__("datetime").timedelta(seconds=5), 3))
    with pytest.raises(RendezvousStateError):
        holder.sync()
    # The plugin's handler reads only through the check.
    handler = create_handler(RendezvousParameters(
        "etcd3", etcd_server.endpoint, keys.job_id, 1, 2, rounds="torch"))
    assert isinstance(handler._state_holder._backend, CheckedBackend)
    with pytest.raises(RendezvousStateError):
        handler._state_holder.sync()
    assert not marker.exists()


# -- the exit barrier after an in-place shrink -------------------------------------------

def _agent_store(client, keys, round_):
    """The store torch's agents run the exit barrier on: the round's PrefixStore over ours."""
    import torch.distributed as dist

    from elasticd.rendezvous.store import EtcdV3Store

    base = EtcdV3Store(client, keys.store)
    return base, dist.PrefixStore(f"torch.rendezvous.{keys.job_id}.{round_}", base)


def _barrier_in_thread(store, world_size, timeout_s):
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
    from torch.distributed.elastic.utils import store as store_util

    outcome = {}

    def run():
        started = time.monotonic()
        try:
            store_util.barrier(store, world_size, _TERMINAL_STATE_SYNC_ID, barrier_timeout=timeout_s)
            outcome["ok"] = time.monotonic() - started
        except Exception as exc:  # the timeout, if the release did not reach torch
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_the_exit_barrier_release_frees_survivors_that_wait_for_lost_agents(client, keys):
    lease = client.grant_lease(60)
    client.put(keys.rdzv_state, state(node("a", 1), node("b", 2), node("c", 3)), lease=lease)
    _base, store = _agent_store(client, keys, 3)
    # Two survivors of a world of three agents: torch would wait its whole timeout.
    waiting = [_barrier_in_thread(store, 3, timeout_s=20) for _ in range(2)]
    time.sleep(0.5)
    assert all(not outcome for _, outcome in waiting)
    assert admin.release_exit_barrier(client, keys, 3, deadline_s=1.0)
    for thread, outcome in waiting:
        thread.join(timeout=10)
        assert "ok" in outcome and outcome["ok"] < 10
    kv = client.get(admin.exit_barrier_key(keys, 3))
    assert kv.lease_id == lease                      # on the run's lease, as torch's keys
    assert not admin.release_exit_barrier(client, keys, 3)   # already set: nothing to do


def test_a_released_barrier_lets_later_arrivals_through_at_once(client, keys):
    client.put(keys.rdzv_state, state(node("a", 1), node("b", 2)))
    assert admin.release_exit_barrier(client, keys, 3)
    _base, store = _agent_store(client, keys, 3)
    thread, outcome = _barrier_in_thread(store, 2, timeout_s=20)
    thread.join(timeout=10)
    assert outcome["ok"] < 5


def test_the_exit_barrier_release_is_fenced_on_the_round(client, keys):
    client.put(keys.rdzv_state, state(node("a", 1), round_=4))
    assert not admin.release_exit_barrier(client, keys, 3)   # a newer round: moot
    assert client.get(admin.exit_barrier_key(keys, 3)) is None
    client.delete(keys.rdzv_state)
    assert not admin.release_exit_barrier(client, keys, 3)


def test_the_exit_barrier_release_is_bounded_when_etcd_is_down():
    down = EtcdClient(EtcdSettings(endpoints=("127.0.0.1:1",), timeout_s=0.5, retry_s=10))
    started = time.monotonic()
    with pytest.raises(EtcdError):
        admin.release_exit_barrier(down, JobKeys("j"), 3, deadline_s=0.5)
    assert time.monotonic() - started < 2
    down.close()
