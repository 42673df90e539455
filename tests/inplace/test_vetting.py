"""The rule an agreed generation record must pass before any worker enters it
(``elasticd.inplace.vetting``): every member borne out by its own node's record, the
store the one rank 0's node publishes."""

from __future__ import annotations

from elasticd.contract.generation import GenerationId, GenerationRecord, grow, renumber, shrink
from elasticd.inplace.vetting import Roster, refusal

G = GenerationId(3, 1, "ep")
STORES = {"a": "127.0.0.1:29600", "b": "127.0.0.1:29601", "c": "127.0.0.1:29602"}
BASE = GenerationRecord(G, renumber([("a", 1), ("b", 1), ("c", 1)]), STORES["a"])
ROSTER = Roster(STORES, {"a": G, "b": G, "c": G})


def test_what_the_daemons_derive_passes():
    assert refusal(shrink(BASE, ["c"], STORES), ROSTER) is None
    assert refusal(shrink(BASE, ["a"], STORES), ROSTER) is None        # the store moves to b
    newcomer = Roster({**STORES, "d": "127.0.0.1:29603"}, ROSTER.worlds, {"d": G})
    assert refusal(grow(BASE, [("d", 2)], STORES["a"]), newcomer) is None
    assert refusal(shrink(BASE, ["c"], STORES, spares=[("d", 1)]), newcomer) is None


def test_a_member_no_live_record_bears_out_is_refused():
    forged = GenerationRecord(G.next(), renumber([("b", 1), ("mallory", 1)]), STORES["b"],
                              lost=("a", "c"))
    assert "mallory a member" in refusal(forged, ROSTER)
    older_world = Roster(STORES, {**ROSTER.worlds, "b": GenerationId(2, 0, "ep")})
    assert "b a member" in refusal(shrink(BASE, ["c"], STORES), older_world)
    other_epoch = Roster(STORES, {**ROSTER.worlds, "b": GenerationId(3, 1, "other")})
    assert "b a member" in refusal(shrink(BASE, ["c"], STORES), other_epoch)


def test_a_joiner_whose_record_says_no_newcomer_waits_is_refused():
    joined = grow(BASE, [("d", 1)], STORES["a"])
    assert "among the joined" in refusal(joined, Roster(STORES, ROSTER.worlds))
    elsewhere = Roster(STORES, ROSTER.worlds, {"d": GenerationId(9, 0, "ep")})
    assert "among the joined" in refusal(joined, elsewhere)
    # Once in, the joiner's record reports the new world and no longer says entering: a
    # member that reads the record only now must still take it.
    entered = Roster(STORES, {**ROSTER.worlds, "d": G.next()})
    assert refusal(joined, entered) is None


def test_a_store_rank_0s_node_does_not_publish_is_refused():
    record = shrink(BASE, ["c"], {**STORES, "a": "10.6.6.6:29500"})
    assert "10.6.6.6:29500 is not the one its rank 0's node a publishes" in refusal(record, ROSTER)
    assert "publishes (none)" in refusal(shrink(BASE, ["c"], STORES),
                                         Roster({"b": STORES["b"]}, ROSTER.worlds))
