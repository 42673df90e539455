"""The keyed rounds' rules (rendezvous/rounds.py), as pure functions: no etcd, no clock."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError

from elasticd.rendezvous.rounds import (
    Agent,
    CorruptRoundError,
    Joined,
    Rules,
    Snapshot,
    World,
    blocking,
    decide,
    decode_pointer,
    encode_pointer,
    nodes_waiting,
)

A, B, C, D = (Agent(f"10.0.0.{i}", 100 + i) for i in range(1, 5))
RULES = Rules(min_nodes=2, max_nodes=3, last_call_s=1.0)


def snap(round_: int, *joined: Agent, previous: tuple[Agent, ...] | None = None,
         alive: tuple[Agent, ...] = ()) -> Snapshot:
    return Snapshot(round_, tuple(Joined(a, 10 + i) for i, a in enumerate(joined)),
                    World(round_ - 1, previous) if previous else None, frozenset(alive))


def test_too_few_waits_without_a_deadline():
    d = decide(snap(0, A), RULES, None, now=5.0)
    assert not d.close and d.ready_since is None and "1 of min_nodes=2" in d.reason


def test_min_nodes_starts_the_last_call_then_closes_in_rank_order():
    d = decide(snap(0, B, A), RULES, None, now=5.0)
    assert not d.close and d.ready_since == 5.0 and d.wait_s == pytest.approx(1.0)
    d = decide(snap(0, B, A), RULES, d.ready_since, now=5.5)
    assert not d.close and d.wait_s == pytest.approx(0.5)
    d = decide(snap(0, B, A), RULES, d.ready_since, now=6.0)
    assert d.close and d.members == (A, B)      # sorted like torch's participants


def test_max_nodes_closes_at_once_with_the_first_joiners():
    d = decide(snap(0, D, C, B, A), RULES, None, now=0.0)
    assert d.close and d.members == (B, C, D)   # A joined fourth: it waits for the next round


def test_a_live_member_of_the_previous_world_holds_the_round_open():
    s = snap(4, A, D, previous=(A, B, C), alive=(B,))
    assert blocking(s) == (B,)                  # C is dead: it does not block
    d = decide(s, RULES, 3.0, now=100.0)
    assert not d.close and d.blocked and d.ready_since is None and B.name in d.reason


def test_dead_members_do_not_block_and_max_overrides_blockers():
    assert decide(snap(4, A, B, previous=(A, B, C)), RULES, 0.0, now=1.0).close
    full = decide(snap(4, A, B, D, previous=(A, B, C), alive=(C,)), RULES, None, now=0.0)
    assert full.close and full.members == (A, B, D)


def test_nodes_waiting_is_silent_when_the_world_is_full():
    assert nodes_waiting(2, 1, RULES) == 1
    assert nodes_waiting(3, 1, RULES) == 0
    assert nodes_waiting(2, 0, RULES) == 0


def test_world_round_trips_and_ranks():
    w = World(7, (A, B))
    back = World.decode(w.encode(), "k")
    assert back == w and back.rank_of(B) == 1 and back.rank_of(C) is None
    assert decode_pointer(encode_pointer(w), "k") == (7, 2)


@pytest.mark.parametrize("raw", [
    b"\x80\x04K\x01.",                                     # a pickle, not JSON
    b"[]",
    json.dumps({"round": -1, "members": [["a", 1, 0]]}).encode(),
    json.dumps({"round": 1, "members": []}).encode(),
    json.dumps({"round": 1, "members": [["a", "1", 0]]}).encode(),
    json.dumps({"round": 1, "members": [["a/b", 1, 0]]}).encode(),
    json.dumps({"round": True, "members": [["a", 1, 0]]}).encode(),
])
def test_a_corrupt_world_is_torchs_state_error_naming_the_key_and_fix(raw):
    with pytest.raises(CorruptRoundError) as err:
        World.decode(raw, "/elasticd/j/rdzv/world/000000000001")
    assert isinstance(err.value, RendezvousStateError)
    assert "/elasticd/j/rdzv/world/000000000001" in str(err.value)
    assert "etcdctl del --prefix /elasticd/j/rdzv/" in str(err.value)


def test_a_corrupt_pointer_names_the_key():
    with pytest.raises(CorruptRoundError, match="etcdctl del /k"):
        decode_pointer(b'{"round": 1}', "/k")


def test_rules_refuse_bad_bounds():
    with pytest.raises(ValueError, match="min <= max"):
        Rules(3, 2, 1.0)


def test_staying_members_are_alive_and_not_waiting_in_the_next_round():
    from elasticd.rendezvous.rounds import staying_members

    names = ["a", "b", "c"]
    assert staying_members(names, {"a", "b", "c"}, set()) == 3
    assert staying_members(names, {"a", "b"}, set()) == 2          # c died
    assert staying_members(names, {"a", "b", "c"}, {"c"}) == 2     # c rejoined: it left
    assert staying_members(names, {"a", "b", "c"}, {"d"}) == 3     # a newcomer is not a member
