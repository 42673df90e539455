"""elasticd.contract.generation: the one definition of a generation and its record (pure, no etcd)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.contract.generation import (
    GenerationId,
    GenerationRecord,
    GenerationRecordError,
    Member,
    WorldView,
    base_of,
    current_world,
    drain,
    grow,
    read_file,
    renumber,
    shrink,
)
from elasticd.inplace.handover import hand_over

G = GenerationId(4, 0, "ep")
STORES = {"a": "10.0.0.1:29600", "b": "10.0.0.2:29600", "c": "10.0.0.3:29600"}
ABC = GenerationRecord(G, renumber([("a", 2), ("b", 2), ("c", 2)]))


def view(node: str, first: int, nproc: int = 2, size: int = 6, gen: GenerationId = G) -> WorldView:
    return WorldView(node, gen, first, nproc, size)


# -- validation ------------------------------------------------------------------------

@pytest.mark.parametrize("make, field", [
    (lambda: GenerationId(-1), "round"),
    (lambda: GenerationId(True), "round"),
    (lambda: GenerationId(1, "2"), "seq"),
    (lambda: GenerationId(1, 0, ""), "epoch"),
    (lambda: Member("", 0, 1), "member node"),
    (lambda: Member("a", 0, 0), "member nproc"),
    (lambda: GenerationRecord(G, ()), "members"),
    (lambda: GenerationRecord(G, (Member("a", 1, 1),)), "members"),
    (lambda: GenerationRecord(G, (Member("a", 0, 1), Member("a", 1, 1))), "members"),
    (lambda: GenerationRecord(G, renumber([("a", 1)]), store="nohost"), "store"),
    (lambda: GenerationRecord(G, renumber([("a", 1)]), planned=1), "planned"),
    (lambda: GenerationRecord(G, renumber([("a", 1)]), planned=True, joined=("z",)), "joined"),
    (lambda: GenerationRecord(G, renumber([("a", 1)]), joined=("a",)), "joined"),
])
def test_invalid_fields_are_named(make, field):
    with pytest.raises(GenerationRecordError, match=f"field {field}="):
        make()


@pytest.mark.parametrize("text", [
    b"not json", b"[]", json.dumps({"format": 2}).encode(),
    json.dumps({"format": 1, "generation": {"round": 1}, "members": "a"}).encode(),
    json.dumps({"format": 1, "generation": {"round": 1},
                "members": [{"node": "a", "first_rank": 0, "nproc": 1}], "lost": [1]}).encode(),
    json.dumps({"format": 1, "generation": 7,
                "members": [{"node": "a", "first_rank": 0, "nproc": 1}]}).encode(),
])
def test_garbage_records_raise_the_record_error_only(text):
    with pytest.raises(GenerationRecordError):
        GenerationRecord.from_json(text)


def test_ordering_is_within_one_round_only():
    assert G.next().newer_than(G) and not G.newer_than(G.next())
    assert not GenerationId(5, 0, "ep").newer_than(G)          # another round: not compared
    assert not GenerationId(4, 1, "other").newer_than(G)       # another epoch
    assert str(G.next()) == "4.1"


# -- shrink ------------------------------------------------------------------------------

def test_shrink_renumbers_the_survivors_in_order():
    nxt = shrink(ABC, ["b"], STORES, "peer-crashed", created=5.0)
    assert nxt.id == G.next() and nxt.nodes == ("a", "c") and nxt.world_size == 4
    assert nxt.members[1] == Member("c", 2, 2) and nxt.store == STORES["a"]
    assert (nxt.lost, nxt.cause) == (("b",), "peer-crashed")


def test_losing_rank_0_moves_the_store_to_the_new_rank_0():
    nxt = shrink(ABC, ["a"], STORES)
    assert nxt.members[0] == Member("b", 0, 2) and nxt.store == STORES["b"]


@pytest.mark.parametrize("lost, stores", [
    (["x"], STORES),                       # not a member: nothing to shrink
    (["a", "b", "c"], STORES),             # no survivors
    (["a"], {"a": STORES["a"]}),           # the new rank 0 hosts no store
])
def test_no_in_place_generation(lost, stores):
    assert shrink(ABC, lost, stores) is None


@given(st.lists(st.integers(1, 4), min_size=1, max_size=6), st.data())
def test_shrink_always_leaves_contiguous_ranks(nprocs, data):
    nodes = [f"n{i}" for i in range(len(nprocs))]
    base = GenerationRecord(G, renumber(zip(nodes, nprocs, strict=True)))
    lost = data.draw(st.sets(st.sampled_from(nodes)))
    nxt = shrink(base, lost, {n: "h:1" for n in nodes})
    if not lost or lost == set(nodes):
        assert nxt is None
        return
    assert nxt.nodes == tuple(n for n in nodes if n not in lost)
    assert nxt.world_size == sum(p for n, p in zip(nodes, nprocs, strict=True) if n not in lost)
    assert GenerationRecord.from_json(nxt.to_json()) == nxt


# -- current_world -----------------------------------------------------------------------

def test_grow_appends_the_joiners_so_every_member_keeps_its_rank():
    base = shrink(ABC, ("c",), STORES)
    assert base is not None
    grown = grow(base, [("c", 2), ("d", 1), ("a", 2)], created=5.0)
    assert [(m.node, m.first_rank, m.nproc) for m in grown.members] == [
        ("a", 0, 2), ("b", 2, 2), ("c", 4, 2), ("d", 6, 1)]
    assert (grown.id, grown.store, grown.planned, grown.joined, grown.lost, grown.cause) == (
        base.id.next(), base.store, True, ("c", "d"), (), "join")
    assert GenerationRecord.from_json(grown.to_json()) == grown
    with pytest.raises(GenerationRecordError, match="field joined="):
        grow(base, [("a", 2)])


def test_a_loss_record_takes_warm_spares_after_the_survivors():
    base = GenerationRecord(G, renumber([("a", 1), ("b", 2), ("c", 1)]))
    stores = {"a": "h:1", "b": "h:2"}
    record = shrink(base, ["b"], stores, "peer-crashed", spares=[("s", 2), ("a", 1)])
    assert [(m.node, m.first_rank, m.nproc) for m in record.members] == [("a", 0, 1), ("c", 1, 1),
                                                                         ("s", 2, 2)]
    assert (record.lost, record.joined, record.planned, record.world_size) == (("b",), ("s",), False, 4)
    assert GenerationRecord.from_json(record.to_json()) == record


def test_drain_is_a_planned_shrink_and_a_loss_record_is_not_planned():
    drained = drain(ABC, ["a"], STORES)
    assert drained is not None and drained.planned and drained.cause == "drain"
    assert (drained.nodes, drained.lost, drained.store) == (("b", "c"), ("a",), STORES["b"])
    lost = shrink(ABC, ["a"], STORES)
    assert lost is not None and not lost.planned
    assert GenerationRecord.from_json(drained.to_json()) == drained
    assert drain(ABC, ["z"], STORES) is None


def test_a_record_without_the_planned_fields_reads_as_a_loss():
    """Records written before planned changes existed (a daemon mid-upgrade)."""
    raw = json.loads(shrink(ABC, ["c"], STORES).to_json())
    del raw["planned"], raw["joined"]
    old = GenerationRecord.from_json(json.dumps(raw))
    assert (old.planned, old.joined) == (False, ())


def test_current_world_from_every_node_report():
    assert current_world([view("c", 4), view("a", 0), view("b", 2)]) == ABC


def test_current_world_takes_the_newest_generation():
    newer = G.next()
    views = [view("a", 0), view("b", 2), view("c", 4),
             view("a", 0, size=4, gen=newer), view("c", 2, size=4, gen=newer)]
    assert current_world(views).nodes == ("a", "c")


@pytest.mark.parametrize("views", [
    [],
    [view("a", 0), view("c", 4)],                       # a gap: b has not reported
    [view("a", 0), view("b", 0), view("c", 4)],         # two nodes claim rank 0
    [view("a", 0), view("b", 2), view("c", 4, size=8)],  # they disagree on the size
    [view("a", 0), view("b", 2)],                       # ranks 4-5 missing at the end
])
def test_current_world_refuses_to_guess(views):
    assert current_world(views) is None


def test_the_base_of_the_next_generation_is_the_agreed_record_or_the_reported_world():
    views = [view("a", 0), view("b", 2), view("c", 4)]
    assert base_of(None, views, G).nodes == ("a", "b", "c")
    assert base_of(None, views[:2], G) is None                      # c has not reported
    agreed = GenerationRecord(G.next(), renumber([("a", 2), ("b", 2)]), "h:1")
    assert base_of(agreed, views[:2], G) == agreed                  # newer, same round
    other_round = GenerationRecord(GenerationId(3, 5, "ep"), renumber([("a", 2)]), "h:1")
    assert base_of(other_round, views, G).id == G                   # not a base
    assert base_of(None, [view("a", 0, gen=GenerationId(3, 0, "ep"))], G) is None


def test_world_views_round_trip_through_the_node_record():
    v = view("a", 0)
    assert WorldView.from_record("a", json.loads(json.dumps(v.to_record()))) == v
    for bad in (None, [], {"generation": {"round": 1}, "first_rank": 4, "nproc": 2, "world_size": 4},
                {"generation": "x", "first_rank": 0, "nproc": 1, "world_size": 1}):
        with pytest.raises(GenerationRecordError):
            WorldView.from_record("a", bad)


# -- the local file ------------------------------------------------------------------------

def test_the_file_round_trips_and_is_replaced_whole(tmp_path):
    path = str(tmp_path / "generation.json")
    assert read_file(path) is None
    hand_over(path, ABC)
    assert read_file(path) == ABC
    nxt = shrink(ABC, ["b"], STORES)
    hand_over(path, nxt)
    assert read_file(path) == nxt and sorted(p.name for p in tmp_path.iterdir()) == ["generation.json"]
