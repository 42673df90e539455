"""Who is dead is decided by a majority (``elasticd.quorum``): the votes, table-tested."""

from __future__ import annotations

import pytest

from elasticd import quorum
from elasticd.supervisor import PeerView


def peers(**suspects: str) -> dict[str, PeerView]:
    """``peers(b="c", c="")``: b suspects c, c suspects nobody."""
    return {n: PeerView(n, suspects=frozenset(s for s in v.split(",") if s))
            for n, v in suspects.items()}


@pytest.mark.parametrize("mine, others, condemned, isolated", [
    ("", dict(b="", c=""), set(), False),              # all well
    ("c", dict(b="c", c=""), {"c"}, False),            # c crashed: 2 of 3
    ("c", dict(b="", c=""), set(), False),             # one vote of 3: a suspicion only
    ("b,c", dict(b="a", c="a"), set(), True),          # a is the one cut off (REJECT)
    ("b", dict(b="a"), set(), False),                  # a world of two: no majority, no isolation
    ("e", dict(b="e", c="e", d="", e=""), {"e"}, False),   # 3 of 5
    ("e", dict(b="e", c="", d="", e=""), set(), False),    # 2 of 5
    ("b,c,d", dict(b="a", c="a", d="a", e="a"), set(), True),  # a reaches 2 of 5
])
def test_a_majority_condemns_and_a_minority_is_cut_off(mine, others, condemned, isolated):
    view = peers(**others)
    votes = {n for n in mine.split(",") if n}
    assert quorum.condemned("a", votes, view) == condemned
    assert quorum.isolated("a", votes, view) is isolated


def test_a_cut_off_node_condemns_nobody_even_with_votes_that_would_count():
    # a suspects b, c and d; b and c (wrongly, say) suspect d: 3 of 5, but a is cut off.
    view = peers(b="d", c="d", d="", e="")
    assert quorum.isolated("a", {"b", "c", "d"}, view)
    assert quorum.condemned("a", {"b", "c", "d"}, view) == frozenset()


def test_a_node_never_votes_against_itself():
    view = peers(b="b")
    assert quorum.votes("b", "a", set(), view) == 0
