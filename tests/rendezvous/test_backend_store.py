"""Contract tests of the etcd v3 rendezvous backend and store, against real etcd servers."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.lease import LeaseKeeper
from elasticd.rendezvous.backend import EtcdV3RendezvousBackend
from elasticd.rendezvous.store import EtcdV3Store
from tests.conftest import connect


@pytest.fixture
def client(any_etcd):
    """Every etcd version here, not only the session's."""
    c = connect(any_etcd, retry_s=5)
    yield c
    c.close()


@pytest.fixture
def store(client, keys):
    return EtcdV3Store(client, keys.store, timeout=timedelta(seconds=10))


# -- backend -------------------------------------------------------------------------------

def st(round_: int) -> bytes:
    """A real pickled torch state (what the agents store)."""
    state = dyn._RendezvousState()
    state.round = round_
    return pickle.dumps(state)


def round_of(state: bytes) -> int:
    return pickle.loads(state).round


@pytest.mark.process
def test_state_absent_then_created(client, keys):
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    assert backend.get_state() is None
    state, token, won = backend.set_state(st(1))
    assert (state, won) == (st(1), True)
    assert backend.get_state() == (st(1), token)
    assert backend.name == "etcd3"


def test_create_if_absent_loses_to_existing_state(client, keys):
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    _, token, _ = backend.set_state(st(1))
    assert backend.set_state(st(2), None) == (st(1), token, False)


def test_stale_token_is_fenced_off(client, keys):
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    _, old, _ = backend.set_state(st(1))
    _, new, won = backend.set_state(st(2), old)
    assert won and new > old
    assert backend.set_state(st(3), old) == (st(2), new, False)


def test_foreign_token_reports_current_state(client, keys):
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    _, token, _ = backend.set_state(st(1))
    assert backend.set_state(st(9), "not-a-revision") == (st(1), token, False)


@pytest.mark.process
def test_cas_race_between_threads_loses_no_update(client, keys):
    """Each thread increments a counter held in the state by read-modify-CAS."""
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    backend.set_state(st(0))
    threads, per_thread = 6, 15
    conflicts = []

    def worker():
        done = 0
        while done < per_thread:
            state, token = backend.get_state()
            _, _, won = backend.set_state(st(round_of(state) + 1), token)
            done += won
            conflicts.append(not won)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert round_of(backend.get_state()[0]) == threads * per_thread
    assert any(conflicts), "the race never happened; the test proved nothing"


def test_state_lives_on_the_run_lease(client, keys):
    lease = LeaseKeeper(client, 60).start()
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state, lease)
    backend.set_state(st(1))
    assert client.get(keys.rdzv_state).lease_id == lease.id
    lease.stop(revoke=True)
    assert backend.get_state() is None, "a dead run's state must not stay in etcd"


# torch's backend contract: the state is opaque bytes, whatever they hold (the check that a
# value read from etcd is a plain rendezvous state is the handler's, CheckedBackend).

def test_any_bytes_are_a_state_and_come_back_as_stored(client, keys):
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    state, token, won = backend.set_state(b"x")
    assert (state, won) == (b"x", True) and backend.get_state() == (b"x", token)
    state, newer, won = backend.set_state(b"\x00y", token)
    assert (state, won) == (b"\x00y", True) and newer != token


@pytest.mark.parametrize("stale", ["old", "none", "invalid"])
def test_a_write_on_a_stale_absent_or_foreign_token_returns_the_current_state(client, keys, stale):
    backend = EtcdV3RendezvousBackend(client, keys.rdzv_state)
    _, first, _ = backend.set_state(b"x")
    current = backend.set_state(b"y", first) if stale == "old" else (b"x", first, True)
    token = {"old": first, "none": None, "invalid": "invalid"}[stale]
    assert backend.set_state(b"z", token) == (current[0], current[1], False)


# -- store ---------------------------------------------------------------------------------

def test_set_get_bytes_and_str(store):
    store.set("a", b"\x00\x01binary")
    store.set("b", "text")
    assert store.get("a") == b"\x00\x01binary"
    assert store.get("b") == b"text"


def test_get_blocks_until_another_thread_sets(store):
    threading.Timer(0.3, lambda: store.set("late", b"v")).start()
    started = time.monotonic()
    assert store.get("late") == b"v"
    assert time.monotonic() - started >= 0.25


def test_wait_times_out_with_a_clear_error(store):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="never"):
        store.wait(["never"], timedelta(seconds=0.5))
    assert 0.4 <= time.monotonic() - started < 5


def test_wait_returns_when_all_keys_exist(store):
    threading.Timer(0.2, lambda: store.multi_set(["k1", "k2"], [b"1", b"2"])).start()
    store.wait(["k1", "k2"], timedelta(seconds=10))
    assert store.multi_get(["k2", "k1"]) == [b"2", b"1"]
    assert store.check(["k1", "k2"]) and not store.check(["k1", "k3"])


@pytest.mark.process
def test_add_under_contention_counts_every_increment(store):
    threads, per_thread = 5, 20

    def worker():
        for _ in range(per_thread):
            store.add("counter", 1)

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert store.add("counter", 0) == threads * per_thread
    assert store.get("counter") == str(threads * per_thread).encode()


def test_compare_set_semantics_match_tcpstore(store):
    assert store.compare_set("cs", "", "first") == b"first"
    assert store.compare_set("cs", "wrong", "x") == b"first"
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.compare_set("absent", "expected", "x") == b"expected"
    assert not store.check(["absent"])


def test_delete_and_num_keys(store):
    store.set("x", b"1")
    store.set("y", b"2")
    assert store.num_keys() == 2
    assert store.delete_key("x") is True
    assert store.delete_key("x") is False
    assert store.num_keys() == 1


def test_through_prefix_store_as_the_agent_uses_it(store):
    """The agent wraps the store in a PrefixStore per round: set/get/add/wait must pass."""
    round_store = dist.PrefixStore("torch.rendezvous.run.3", store)
    round_store.set("MASTER_ADDR", "127.0.0.1")
    assert round_store.get("MASTER_ADDR") == b"127.0.0.1"
    assert round_store.add("barrier", 2) == 2
    round_store.wait(["barrier"], timedelta(seconds=5))
    assert store.get("torch.rendezvous.run.3/MASTER_ADDR") == b"127.0.0.1"


def test_store_keys_expire_with_the_run_lease(client, keys):
    lease = LeaseKeeper(client, 60).start()
    store = EtcdV3Store(client, keys.store, lease)
    store.set("k", b"v")
    store.add("n", 1)
    lease.stop(revoke=True)
    assert client.get_prefix(keys.store) == []
