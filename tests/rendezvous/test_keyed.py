"""Keyed rounds (``--rdzv-conf rounds=keyed``) against a real etcd: several handlers, as
torchrun builds them, in threads of this process."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from structlog.testing import capture_logs
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from elasticd.contract.generation import GenerationId
from elasticd.contract.settings import ENTER_FILE_ENV, JOINING_ENV, LEAVE_FILE_ENV
from elasticd.errors import ConfigError
from elasticd.rendezvous import admin
from elasticd.rendezvous.entering import write_entry
from elasticd.rendezvous.handler import create_handler, parse_params
from elasticd.rendezvous.keyed import KeyedRendezvousHandler
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.rounds import World
from tests.conftest import connect


@pytest.fixture
def make(etcd_server, job_id):
    made: list[KeyedRendezvousHandler] = []

    def build(i: int, min_nodes: int = 2, max_nodes: int = 3, **conf: str) -> KeyedRendezvousHandler:
        settings = {"rounds": "keyed", "last_call_timeout": "1", "keep_alive_interval": "1",
                    "keep_alive_max_attempt": "3", "join_timeout": "30", **conf}
        handler = create_handler(RendezvousParameters(
            "etcd3", etcd_server.endpoint, job_id, min_nodes, max_nodes,
            local_addr=f"127.0.0.{i + 1}", **settings))
        assert isinstance(handler, KeyedRendezvousHandler)
        made.append(handler)
        return handler

    yield build
    for handler in made:
        handler._alive.stop(revoke=True)


@pytest.fixture
def client(etcd_server):
    c = connect(etcd_server)
    yield c
    c.close()


def rendezvous_all(handlers):
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), handlers))


def test_three_agents_form_one_world_with_distinct_ranks_and_one_master(make):
    infos = rendezvous_all([make(i) for i in range(3)])
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    masters = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
               for i in infos}
    assert len(masters) == 1 and next(iter(masters))[0] == "127.0.0.1"   # rank 0 sorts first


def test_a_round_costs_a_few_writes_per_agent_not_per_pair(make, client, job_id):
    keys = JobKeys(job_id)
    _, before = client.get_many([keys.rdzv_round])
    n = 8
    infos = rendezvous_all([make(i, min_nodes=n, max_nodes=n) for i in range(n)])
    _, after = client.get_many([keys.rdzv_round])
    assert {i.world_size for i in infos} == {n}
    # Per agent: its liveness key and its join (2 each); the leader's close (1); rank 0's
    # MASTER_ADDR/PORT (2); the generation epoch (1). torch's shared state costs O(n^2).
    assert after - before <= 2 * n + 4, after - before


@pytest.mark.process
def test_survivors_re_form_without_the_evicted_agent(make, client, job_id):
    handlers = [make(i) for i in range(3)]
    rendezvous_all(handlers)
    dead = handlers[2]
    removal = admin.evict_agents(client, JobKeys(job_id), {(dead.agent.addr, dead.agent.pid)}, 2)
    assert removal.in_round and removal.removed == (dead.agent.name,)
    dead._alive.stop(revoke=False)       # a dead agent renews nothing
    started = time.monotonic()
    infos = rendezvous_all(handlers[:2])
    took = time.monotonic() - started
    assert {i.world_size for i in infos} == {2} and sorted(i.rank for i in infos) == [0, 1]
    assert handlers[0].world.round == 1
    assert took < 10, took      # the last call (1 s), not the liveness lease (3 s) and more


@pytest.mark.process
def test_a_dead_agent_that_nobody_evicts_blocks_until_its_lease_expires(make):
    handlers = [make(i) for i in range(3)]
    rendezvous_all(handlers)
    handlers[2]._alive.stop(revoke=False)          # killed: its lease (3 s) runs out
    infos = rendezvous_all(handlers[:2])
    assert {i.world_size for i in infos} == {2}


@pytest.mark.process
def test_a_newcomer_is_waiting_for_the_members_then_all_re_form(make):
    members = [make(i) for i in range(2)]
    rendezvous_all(members)
    newcomer = make(2)
    pending = ThreadPoolExecutor(1).submit(newcomer.next_rendezvous)
    deadline = time.monotonic() + 10
    while members[0].num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "the members never saw the newcomer waiting"
        time.sleep(0.2)
    infos = rendezvous_all(members) + [pending.result(timeout=30)]
    assert {i.world_size for i in infos} == {3} and members[0].world.round == 1


@pytest.mark.process
def test_a_full_world_does_not_restart_for_a_spare_and_the_spare_times_out(make):
    members = [make(i, max_nodes=2) for i in range(2)]
    rendezvous_all(members)
    spare = make(2, max_nodes=2, join_timeout="3")
    with pytest.raises(RendezvousTimeoutError, match="join_timeout"):
        spare.next_rendezvous()
    members[0]._waiting = (float("-inf"), 0)
    assert members[0].num_nodes_waiting() == 0


@pytest.mark.process
def test_only_a_successful_shutdown_closes_the_rendezvous(make, job_id):
    handlers = [make(i) for i in range(2)]
    rendezvous_all(handlers)
    try:
        raise RuntimeError("workers failed")
    except RuntimeError:
        handlers[1].shutdown()            # giving up: leaves, does not close
    assert not handlers[0].is_closed()
    handlers[0].shutdown()                # success
    assert handlers[1].is_closed()
    # The error says what happened and names the keys to delete (torchrun prints it last).
    with pytest.raises(RendezvousClosedError, match=f"is closed: a run with this id completed.*"
                                                    f"del --prefix /elasticd/{job_id}/$"):
        make(3).next_rendezvous()


@pytest.mark.parametrize("rounds", ["keyed", "torch"])
def test_a_drained_node_leaves_instead_of_joining_and_nobody_waits_for_it(make, etcd_server, job_id,
                                                                          client, tmp_path,
                                                                          monkeypatch, rounds):
    """The daemon drains its node in place: once its workers stop, torch's agent would join
    the next round (and every survivor would restart its workers for the "waiting" node).
    With the leave file it leaves, ends its run, and never closes the rendezvous."""
    leave = tmp_path / "leave"
    monkeypatch.setenv(LEAVE_FILE_ENV, str(leave))
    if rounds == "keyed":
        stay, drained = make(0), make(1)
        rendezvous_all([stay, drained])
    else:
        stay = drained = create_handler(RendezvousParameters(
            "etcd3", etcd_server.endpoint, job_id, 1, 2, local_addr="127.0.0.9", rounds="torch",
            last_call_timeout="1"))
        drained.next_rendezvous()                  # no file yet: an ordinary round
    leave.touch()
    with capture_logs() as logs, pytest.raises(RendezvousGracefulExitError, match="drained"):
        drained.next_rendezvous()
    assert any(e["event"].startswith("this node is drained in place") for e in logs), logs
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    drained.shutdown()                             # torch's launcher still calls it: a no-op
    assert not stay.is_closed()
    if rounds == "keyed":
        keys = JobKeys(job_id)
        assert client.get(f"{keys.rdzv_alive}{drained.agent.name}") is None   # left
        assert client.count_prefix(keys.rdzv_joins(stay.world.round + 1)) == 0  # joined nothing
        assert stay.num_nodes_waiting() == 0


def test_a_node_entering_in_place_takes_a_world_of_its_own_and_nobody_waits_for_it(
        make, client, job_id, tmp_path, monkeypatch):
    """A join in place: the enter file (the live generation) gives this agent a world of
    its own, its workers started as newcomers of that round; the members' agents see
    nobody waiting. The file is read once: the next rendezvous is an ordinary one."""
    enter = tmp_path / "enter"
    monkeypatch.setenv(ENTER_FILE_ENV, str(enter))
    monkeypatch.delenv(JOINING_ENV, raising=False)
    members = [make(0), make(1)]
    rendezvous_all(members)
    live = members[0].world.round
    newcomer = make(2)
    write_entry(enter, GenerationId(live, 4, newcomer.epoch()))
    info = newcomer.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1) and not enter.exists()
    assert os.environ[JOINING_ENV] == "1" and os.environ["ELASTICD_GENERATION"] == str(live)
    assert os.environ["ELASTICD_GENERATION_EPOCH"] == newcomer.epoch()
    info.store.set("k", "mine")   # its own prefix: no member's key
    keys = JobKeys(job_id)
    assert client.count_prefix(keys.rdzv_joins(live + 1)) == 0
    assert all(m.num_nodes_waiting() == 0 for m in members)
    assert newcomer.world == members[0].world   # it watches the members' next round too
    # A garbled file is one warning and an ordinary round (here: the next one, with all three).
    enter.write_bytes(b"\x80garbage")
    with capture_logs() as logs:
        infos = rendezvous_all([*members, newcomer])
    assert {i.world_size for i in infos} == {3} and JOINING_ENV not in os.environ
    assert any(e["event"].startswith("ignoring the enter file") for e in logs), logs


@pytest.mark.process
def test_a_corrupt_world_is_stepped_over_with_a_warning_never_fatal(make, client, job_id):
    keys = JobKeys(job_id)
    client.put(keys.rdzv_world(0), b"\x80\x04cos\nsystem\n.")     # a pickle: never loaded
    handler = make(0, min_nodes=1)
    with capture_logs() as logs:
        info = handler.next_rendezvous()
    assert info.world_size == 1 and handler.world.round == 1
    assert admin.current_round(client, keys).round == 1
    warned = [e for e in logs if e.get("key") == keys.rdzv_world(0)]
    assert len(warned) == 1 and "etcdctl del --prefix" in warned[0]["problem"], logs


def test_a_corrupt_pointer_is_repaired_above_every_existing_round(make, client, job_id):
    keys = JobKeys(job_id)
    rendezvous_all([make(0, min_nodes=1, max_nodes=1)])
    client.put(keys.rdzv_round, b"not json")
    handler = make(1, min_nodes=1, max_nodes=1)
    info = handler.next_rendezvous()
    assert info.world_size == 1 and handler.world.round == 1      # above world 0's record
    assert admin.current_round(client, keys).round == 1             # a good pointer again


@pytest.mark.process
def test_a_world_record_under_another_rounds_key_is_refused(make, client, job_id):
    keys = JobKeys(job_id)
    client.put(keys.rdzv_world(0), b'{"round": 5, "members": [["127.0.0.9", 1, 0]]}')
    handler = make(0, min_nodes=1)
    handler.next_rendezvous()
    assert handler.world.round == 1 and handler.world.rank_of(handler.agent) == 0


@pytest.mark.process
def test_the_jobs_round_world_and_epoch_outlive_every_agents_lease(make, client, job_id):
    # Issue 29 finding 2: the pointer and world were on the round leader's run lease and
    # the epoch on its creator's. In place, the job trains on without a new round; 2 h
    # (the lease's TTL) after the leader's node was lost, they vanished and the next
    # rendezvous started at round 0 under a new epoch: a second world beside the first.
    keys = JobKeys(job_id)
    handlers = [make(i) for i in range(2)]
    rendezvous_all(handlers)
    epoch = os.environ["ELASTICD_GENERATION_EPOCH"]
    for handler in handlers:                  # what their expiry does: every lease gone
        client.revoke_lease(handler._run_lease.id)
        client.revoke_lease(handler._alive.id)
        handler._alive.stop(revoke=False)
    found, _ = client.get_many([keys.rdzv_round, keys.rdzv_world(0), keys.rdzv_epoch])
    assert set(found) == {keys.rdzv_round, keys.rdzv_world(0), keys.rdzv_epoch}
    assert all(kv.lease_id == 0 for kv in found.values())
    rejoined = [make(i + 5) for i in range(2)]
    rendezvous_all(rejoined)
    assert {h.world.round for h in rejoined} == {1}
    assert os.environ["ELASTICD_GENERATION_EPOCH"] == epoch


def test_a_leader_that_read_an_older_pointer_cannot_move_it_back(make, client, job_id):
    # A round's leader froze before closing; the others closed rounds past it and pruned
    # its round's record. Woken, its close must not rewrite the pointer to its round.
    keys = JobKeys(job_id)
    late = make(9, min_nodes=1, max_nodes=1)
    stale_fence = 0                                        # it read: no pointer yet
    for i in range(3):
        rendezvous_all([make(i, min_nodes=1, max_nodes=1)])
    client.delete(keys.rdzv_world(0))                      # pruned, as closes do
    late._close(World(0, (late.agent,)), "late", stale_fence)
    assert client.get(keys.rdzv_world(0)) is None
    assert admin.current_round(client, keys).round == 2
    late.next_rendezvous()
    assert late.world.round == 3


@pytest.mark.process
def test_the_daemon_view_and_reopen_work_on_keyed_rounds(make, client, job_id):
    keys = JobKeys(job_id)
    handlers = [make(i) for i in range(2)]
    rendezvous_all(handlers)
    view = admin.current_round(client, keys)
    assert view.round == 0 and view.complete and not view.closed and view.world_nodes == 2
    assert view.participants == tuple((h.agent.addr, h.agent.pid) for h in handlers)
    handlers[0].set_closed()
    assert admin.current_round(client, keys).closed
    assert admin.reopen_if_closed(client, keys)
    assert not handlers[1].is_closed()


def test_an_expired_liveness_lease_is_granted_anew_with_the_keys_back(make, client, job_id):
    keys = JobKeys(job_id)
    handler = make(0, min_nodes=1, max_nodes=1)
    handler.next_rendezvous()
    client.revoke_lease(handler._alive.id)
    assert client.get(keys.rdzv_alive + handler.agent.name) is None
    handler._alive.refresh_once()          # what its keep-alive thread does next
    assert client.get(keys.rdzv_alive + handler.agent.name) is not None


@pytest.mark.process
def test_a_full_world_that_lost_a_member_takes_a_newcomer(make, client, job_id):
    # An in-place shrink keeps the rendezvous world of 3 while its third member is dead:
    # the newcomer must still make the live members restart into a new round.
    members = [make(i, max_nodes=3) for i in range(3)]
    rendezvous_all(members)
    dead = members[2]
    admin.evict_agents(client, JobKeys(job_id), {(dead.agent.addr, dead.agent.pid)}, 2)
    dead._alive.stop(revoke=False)
    newcomer = make(3, max_nodes=3)
    pending = ThreadPoolExecutor(1).submit(newcomer.next_rendezvous)
    deadline = time.monotonic() + 10
    while members[0].num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "a full world that lost a member ignored the newcomer"
        time.sleep(0.2)
    infos = rendezvous_all(members[:2]) + [pending.result(timeout=30)]
    assert {i.world_size for i in infos} == {3}


def test_a_join_on_an_expired_liveness_lease_renews_it_instead_of_failing(make, client, job_id):
    # Seen at 128 packed agents: a starved agent's lease ran out before its join's put,
    # and the put failed with "requested lease not found", killing the agent.
    keys = JobKeys(job_id)
    handler = make(0, min_nodes=1, max_nodes=1)
    handler.next_rendezvous()
    client.revoke_lease(handler._alive.id)
    info = handler.next_rendezvous()
    assert info.world_size == 1
    assert client.get(keys.rdzv_alive + handler.agent.name) is not None


@pytest.mark.process
def test_a_member_that_rejoins_the_next_round_has_left_the_full_world(make, client, job_id):
    # Seen on the chaos matrix (keyed rounds, node-stop): a frozen member outlived its
    # lease, was shrunk out in place, woke, renewed its liveness key and joined the next
    # round; the others counted it as a live member of their full world (no one waiting),
    # its round waited for them: the world of 3 never came back.
    members = [make(i, max_nodes=3) for i in range(3)]
    rendezvous_all(members)
    returning = members[2]
    pending = ThreadPoolExecutor(1).submit(returning.next_rendezvous)   # alive, rejoining
    deadline = time.monotonic() + 10
    while members[0].num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "a member waiting in the next round was not seen"
        time.sleep(0.2)
    infos = rendezvous_all(members[:2]) + [pending.result(timeout=30)]
    assert {i.world_size for i in infos} == {3} and members[0].world.round == 1


def _stray_joins(client, keys: JobKeys, round_: int) -> dict[str, str]:
    """Issue 27's finding 2, three ways: join keys no agent of the plugin wrote, under
    ``round_``: on no lease, garbage on a lease, and a well-formed agent on a lease whose
    liveness key does not exist."""
    lease = client.grant_lease(60)
    forged = {"leaseless": (b'["10.9.9.9", 1, 0]', None), "garbage": (b"\x80garbage", lease),
              "10.9.9.8_2_0": (b'["10.9.9.8", 2, 0]', lease)}
    for name, (value, on) in forged.items():
        client.put(keys.rdzv_joins(round_) + name, value, on)
    return {name: keys.rdzv_joins(round_) + name for name in forged}


@pytest.mark.process
def test_stray_join_keys_make_no_node_waiting_and_are_removed(make, client, job_id):
    keys = JobKeys(job_id)
    members = [make(i) for i in range(2)]
    rendezvous_all(members)
    strays = _stray_joins(client, keys, 1)
    assert client.count_prefix(keys.rdzv_joins(1)) == 3
    with capture_logs() as logs:
        assert [m.num_nodes_waiting() for m in members] == [0, 0]
    assert admin.current_round(client, keys).waiting == 0
    # The two that no agent can have written are removed; the forged agent is not counted.
    assert client.get(strays["leaseless"]) is None and client.get(strays["garbage"]) is None
    assert client.get(strays["10.9.9.8_2_0"]) is not None
    warned = {e["key"] for e in logs if e["event"] == "ignoring a join key that counts for no agent"}
    assert warned == set(strays.values()), logs


@pytest.mark.process
def test_a_round_whose_oldest_join_keys_are_stray_still_closes(make, client, job_id):
    # The stray keys are older than every agent's join: the oldest one was the round's
    # "leader", and the round never closed (every daemon failed 5 join timeouts later).
    keys = JobKeys(job_id)
    _stray_joins(client, keys, 0)
    handlers = [make(i, min_nodes=2, max_nodes=2, join_timeout="20") for i in range(2)]
    infos = rendezvous_all(handlers)
    assert {i.world_size for i in infos} == {2} and sorted(i.rank for i in infos) == [0, 1]
    assert handlers[0].world.members == tuple(sorted(h.agent for h in handlers))


def test_keyed_rounds_are_the_default_and_torchs_layout_stays_selectable():
    def rounds(**conf: str) -> str:
        params = RendezvousParameters("etcd3", "127.0.0.1:2379", "job-1", 1, 2, **conf)
        return parse_params(params).rounds
    assert rounds() == "keyed"
    assert rounds(rounds=" Torch ") == "torch"
    with pytest.raises(ConfigError, match=r"rounds='shared'.*keyed.*torch"):
        rounds(rounds="shared")
