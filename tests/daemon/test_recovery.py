"""The daemon's side of in-place recovery on real etcd: the agreement on the next
generation (one compare-and-set; racing daemons end with one record), the TCP store
each daemon hosts, and the validated reads it rests on (records, progress, job keys)."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest

from elasticd.contract.generation import Entering, GenerationId, GenerationRecord, WorldView, renumber
from elasticd.contract.progress import Reform, parse_progress
from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.inplace.agreement import drain_world, shrink_world
from elasticd.inplace.store import StoreHost
from elasticd.inplace.vetting import Roster
from elasticd.membership import parse_record
from elasticd.observer import JobReader
from elasticd.rendezvous.keys import JobKeys

G = GenerationId(2, 0, "ep")
STORES = {"a": "127.0.0.1:29600", "b": "127.0.0.1:29601", "c": "127.0.0.1:29602"}
VIEWS = [WorldView("a", G, 0, 1, 3), WorldView("b", G, 1, 1, 3), WorldView("c", G, 2, 1, 3)]


def roster(views=VIEWS, stores=STORES) -> Roster:
    """What the nodes' records say: their stores and worlds (``vetting``)."""
    return Roster(stores, {v.node: v.generation for v in views})


def shrink_as(client, keys, node, lost=("c",), views=VIEWS, stores=STORES, workers=G):
    return shrink_world(client, keys, node, lost, "peer-crashed", workers, views,
                        roster(views, stores), deadline_s=2.0)


def agreed(client, keys) -> GenerationRecord:
    return GenerationRecord.from_json(client.get(keys.generation).value)


def test_the_first_shrink_writes_the_next_generation(client, keys):
    out = shrink_as(client, keys, "a")
    assert (out.status, out.wrote) == ("ok", True)
    assert out.record == agreed(client, keys)
    assert out.record.id == G.next() and out.record.nodes == ("a", "b")
    assert out.record.store == STORES["a"] and out.record.lost == ("c",)


def test_the_second_daemon_adopts_the_first_ones_record(client, keys):
    first = shrink_as(client, keys, "a")
    revision = client.get(keys.generation).mod_revision
    second = shrink_as(client, keys, "b")
    assert (second.status, second.wrote, second.record) == ("ok", False, first.record)
    assert client.get(keys.generation).mod_revision == revision   # adopted, not rewritten


def test_racing_daemons_end_with_one_record(etcd_server, keys):
    clients = [EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,))) for _ in range(2)]
    outs: dict[str, object] = {}
    go = threading.Barrier(2)

    def daemon(node, c):
        go.wait()
        outs[node] = shrink_as(c, keys, node)

    threads = [threading.Thread(target=daemon, args=(n, c)) for n, c in zip("ab", clients, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(o.wrote for o in outs.values()) == [False, True]
    assert outs["a"].record == outs["b"].record == agreed(clients[0], keys)
    assert {o.status for o in outs.values()} == {"ok"}
    for c in clients:
        c.close()


def test_a_second_loss_shrinks_the_agreed_record_not_the_old_world(client, keys):
    shrink_as(client, keys, "a", lost=("c",))
    # b dies too; a's workers still report G (they have not re-formed yet).
    out = shrink_as(client, keys, "a", lost=("b", "c"))
    assert out.status == "ok" and out.record.id == G.next().next() and out.record.nodes == ("a",)


def test_the_lost_rank_0_fences_nobody_else_and_moves_the_store(client, keys):
    out = shrink_as(client, keys, "b", lost=("a",))
    assert out.record.members[0].node == "b" and out.record.store == STORES["b"]
    fenced = shrink_as(client, keys, "a", lost=("c",))   # a is out of the agreed record
    assert fenced.status == "fenced"


def test_no_generation_without_the_new_rank_0s_store(client, keys):
    out = shrink_as(client, keys, "b", lost=("a",), stores={"a": STORES["a"]})
    assert out.status == "failed" and "store" in out.reason
    assert client.get(keys.generation) is None


def test_no_generation_when_the_records_do_not_cover_the_world(client, keys):
    out = shrink_as(client, keys, "a", views=VIEWS[:2])        # c's last view is missing
    assert out.status == "failed" and "do not cover" in out.reason


def test_a_lost_node_outside_our_world_needs_nothing(client, keys):
    assert shrink_as(client, keys, "a", lost=("x",)).status == "unneeded"


def test_a_record_of_another_round_is_not_a_base(client, keys):
    old = GenerationRecord(GenerationId(1, 3, "ep"), renumber([("a", 1)]), STORES["a"])
    client.put(keys.generation, old.to_json().encode())
    out = shrink_as(client, keys, "a")
    assert out.status == "ok" and out.record.id == G.next() and out.record.nodes == ("a", "b")


def test_a_garbled_record_is_replaced(client, keys):
    client.put(keys.generation, b"{garbage")
    assert shrink_as(client, keys, "a").status == "ok"
    assert agreed(client, keys).id == G.next()


def test_a_newer_record_the_nodes_records_do_not_bear_out_is_neither_adopted_nor_built_on(
        client, keys):
    # Issue 27 finding 1: one put named a foreign member and its store; b adopted it
    # (it already left c out) and its workers formed a group with the attacker.
    forged = GenerationRecord(G.next(), renumber([("b", 1), ("mallory", 1)]), "10.6.6.6:29500",
                              lost=("a", "c"))
    client.put(keys.generation, forged.to_json().encode())
    out = shrink_as(client, keys, "b", lost=("c",))
    assert out.status == "failed" and "refused" in out.reason and "mallory" in out.reason
    assert agreed(client, keys) == forged                 # not overwritten: it may be true
    assert drain_as(client, keys, "b").status == "failed"


def test_etcd_down_raises_for_the_callers_fallback():
    down = EtcdClient(EtcdSettings(endpoints=("127.0.0.1:1",), timeout_s=0.5, retry_s=10))
    with pytest.raises(EtcdError):
        shrink_as(down, JobKeys("j"), "a")
    down.close()


# -- a drain in place: the leaver's daemon agrees a planned record without itself ---------

def drain_as(client, keys, node, views=VIEWS, stores=STORES, workers=G):
    return drain_world(client, keys, node, workers, views, roster(views, stores), deadline_s=2.0)


def test_a_drain_writes_a_planned_record_without_the_leaver(client, keys):
    out = drain_as(client, keys, "b")
    assert (out.status, out.wrote) == ("ok", True)
    assert out.record == agreed(client, keys)
    assert out.record.id == G.next() and out.record.nodes == ("a", "c")
    assert out.record.planned and out.record.cause == "drain" and out.record.lost == ("b",)
    assert out.record.store == STORES["a"]


def test_the_rank_0_node_drains_and_the_store_moves_to_the_next(client, keys):
    out = drain_as(client, keys, "a")
    assert out.status == "ok" and out.record.members[0].node == "b"
    assert out.record.store == STORES["b"]


def test_a_repeated_drain_adopts_its_own_record(client, keys):
    first = drain_as(client, keys, "b")
    again = drain_as(client, keys, "b")
    assert (again.status, again.wrote, again.record) == ("ok", False, first.record)


def test_a_drain_does_not_stack_on_a_change_agreed_first(client, keys):
    """A loss agreed first (c crashed) is our workers' to take before anyone leaves their
    world: a drain on top of it would be two generations ahead of them."""
    shrink_as(client, keys, "a", lost=("c",))
    out = drain_as(client, keys, "b")
    assert out.status == "failed" and "another change" in out.reason
    assert agreed(client, keys).id == G.next()   # the loss's record, untouched


def test_no_drain_in_place_of_the_last_node_or_without_a_store(client, keys):
    alone = [WorldView("a", G, 0, 1, 1)]
    out = drain_as(client, keys, "a", views=alone)
    assert out.status == "failed" and out.reason == "no survivors"
    out = drain_as(client, keys, "a", stores={"a": STORES["a"]})
    assert out.status == "failed" and "store" in out.reason
    assert client.get(keys.generation) is None


# -- the store each daemon hosts ---------------------------------------------------------

def test_the_store_host_serves_clients_under_a_generation_prefix():
    import torch.distributed as dist

    host = StoreHost("127.0.0.1", 0).start()
    try:
        addr, port = host.endpoint.rsplit(":", 1)
        record = GenerationRecord(G.next(), renumber([("a", 1)]), host.endpoint)
        c = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=5))
        ours = dist.PrefixStore(record.store_prefix, c)
        ours.set("k", "v")
        assert ours.get("k") == b"v"
        assert dist.PrefixStore(record.store_prefix, dist.TCPStore(
            addr, int(port), is_master=False, timeout=timedelta(seconds=5))).get("k") == b"v"
    finally:
        host.stop()


def test_handing_a_generation_prunes_the_store_of_every_older_one():
    # Issue 27 finding 4: the store kept every generation's keys for the daemon's life.
    import torch.distributed as dist

    host = StoreHost("127.0.0.1", 0).start()
    try:
        addr, port = host.endpoint.rsplit(":", 1)
        c = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=5))
        gens = [GenerationId(1, 4, "ep"), G, G.next(), G.next().next(), GenerationId(2, 0, "old")]
        for gen in gens:
            dist.PrefixStore(gen.store_prefix, c).set("k", "v")
        c.set("not-a-generation", "v")
        assert host.prune(G.next()) == 3            # round 1, seq 0 of round 2, the old epoch
        left = sorted(c.list_keys())
        assert left == sorted(["not-a-generation", G.next().store_prefix + "/k",
                               G.next().next().store_prefix + "/k"]), left
    finally:
        host.stop()


def test_a_taken_store_port_leaves_no_endpoint():
    first = StoreHost("127.0.0.1", 0).start()
    try:
        port = int(first.endpoint.rsplit(":", 1)[1])
        assert StoreHost("127.0.0.1", port).start().endpoint is None
    finally:
        first.stop()


# -- validated reads ---------------------------------------------------------------------

def _record(**fields) -> bytes:
    return json.dumps({"state": "running", "addr": "127.0.0.1", **fields}).encode()


def test_a_peer_record_carries_its_world_and_store():
    world = VIEWS[1].to_record()
    peer = parse_record("b", _record(world=world, store=STORES["b"]), 7)
    assert peer.view().world == VIEWS[1] and peer.view().store == STORES["b"]


@pytest.mark.parametrize("fields", [
    {"world": "x", "store": 5}, {"world": {"generation": {"round": -1}}, "store": "nohost"},
    {"world": {**VIEWS[1].to_record(), "nproc": 0}, "store": "h:99999"},
])
def test_a_garbled_world_or_store_leaves_them_unknown_not_the_peer(fields):
    peer = parse_record("b", _record(**fields), 7)
    assert peer is not None and peer.state == "running"
    assert (peer.view().world, peer.view().store) == (None, None)


def test_a_peer_record_says_its_newcomers_wait_to_enter_a_world():
    entering = Entering("b", G, True, 2)
    peer = parse_record("b", _record(entering=entering.to_record()), 7)
    assert peer.view().entering == entering
    for bad in ("x", {"generation": G.as_dict(), "warm": "yes", "nproc": 1},
                {"generation": G.as_dict(), "warm": True, "nproc": 0}, {"warm": False, "nproc": 1}):
        peer = parse_record("b", _record(entering=bad), 7)
        assert peer is not None and peer.view().entering is None, bad


def test_progress_carries_the_generation_and_the_reform_report():
    p = parse_progress({"event": "reformed", "step": 9, "world_size": 2, "rank": 0,
                        "local_world_size": 1, "generation": {"round": 2, "seq": 1, "epoch": "ep"},
                        "from_world_size": 3, "duration_s": 0.7, "cause": "peer-crashed"})
    assert p.generation == G.next() and p.world("a") == WorldView("a", G.next(), 0, 1, 2)
    assert p.reform == Reform("reformed", 0.7, 3, "peer-crashed", None)
    failed = parse_progress({"event": "reform-failed", "step": 9, "reason": "timeout",
                             "duration_s": 5})
    assert failed.reform == Reform("reform-failed", 5.0, None, None, "timeout")


def test_garbled_progress_generations_leave_the_world_unknown():
    for bad in ({"round": "x"}, [], {"round": 1, "epoch": 5}):
        p = parse_progress({"event": "step", "step": 3, "world_size": 2, "rank": 0,
                            "local_world_size": 1, "generation": bad})
        assert p is not None and p.step == 3 and p.generation is None and p.world("a") is None
    assert parse_progress({"event": "step", "local_world_size": "1"}) is None


def test_the_job_reader_reads_again_as_soon_as_the_generation_changes(client, keys):
    clock = [100.0]
    reader = JobReader(client, keys, "a", every_s=60.0, clock=lambda: clock[0])
    reader.watch()
    try:
        assert reader.read().generation is None
        record = GenerationRecord(G.next(), renumber([("a", 1)]), STORES["a"], ("b",))
        client.put(keys.generation, record.to_json().encode())
        clock[0] += 0.1   # far inside the period: only the watch makes this a read
        deadline = time.monotonic() + 5
        while reader.read().generation != record and time.monotonic() < deadline:
            time.sleep(0.02)
        assert reader.view.generation == record
    finally:
        reader.unwatch()
    # Without the watch the period holds: the next change waits for it.
    client.put(keys.generation, b"[1]")
    time.sleep(0.3)
    assert reader.read().generation == record


def test_the_job_reader_reads_the_agreed_generation(client, keys):
    reader = JobReader(client, keys, "a", every_s=0.0)
    assert reader.read().generation is None
    record = GenerationRecord(G.next(), renumber([("a", 1)]), STORES["a"], ("b",))
    client.put(keys.generation, record.to_json().encode())
    assert reader.read().generation == record
    client.put(keys.generation, b"[1]")
    assert reader.read().generation is None
