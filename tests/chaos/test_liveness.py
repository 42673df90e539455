"""The liveness invariant's arithmetic (``elasticd.lab.chaos.liveness``) on hand-made timelines:
it passes a job that steps whenever enough nodes have settled, and bites on a stall."""

from __future__ import annotations

import math

from elasticd.lab.chaos import liveness as lv

INF = math.inf
NODES = ("a", "b", "c")


def _steps(*spans: tuple[float, float]) -> list[float]:
    """A step record every 0.1 s in each span."""
    return [round(a + i * 0.1, 3) for a, b in spans for i in range(int((b - a) / 0.1) + 1)]


def test_pauses_are_the_gaps_longer_than_a_second_cut_to_the_window():
    found = lv.pauses(_steps((0, 10), (14, 20)), 0, 30)
    assert [(p.start, p.length_s) for p in found] == [(10.0, 4.0), (20.0, 10.0)]
    assert lv.longest(found) == lv.Pause(20.0, 10.0)


def test_a_recovery_within_the_bound_is_no_violation():
    # b crashed at 10 and never came back; the job stepped again at 22 (12 s < 20 s bound).
    steps = _steps((0, 10), (22, 60))
    assert lv.violations(steps, {"b": [(10, INF)]}, NODES, 0, 60, 2, 20) == []


def test_a_stall_with_two_settled_nodes_is_a_violation_from_the_bound_on():
    steps = _steps((0, 10), (50, 60))     # nothing from 10 to 50 with a and c settled
    (v,) = lv.violations(steps, {"b": [(10, INF)]}, NODES, 0, 60, 2, 20)
    assert (v.start, v.length_s, v.nodes) == (30.0, 20.0, ("a", "c"))


def test_a_stall_while_too_few_nodes_are_settled_is_not_owed():
    # b out for good at 10, c frozen 10-40: only a is settled until c's 40 + 20.
    steps = _steps((0, 10), (55, 70))
    assert lv.violations(steps, {"b": [(10, INF)], "c": [(10, 40)]}, NODES, 0, 70, 2, 20) == []
    late = _steps((0, 10), (65, 70))      # ... but owed from 60 on
    (v,) = lv.violations(late, {"b": [(10, INF)], "c": [(10, 40)]}, NODES, 0, 70, 2, 20)
    assert (v.start, v.nodes) == (60.0, ("a", "c"))


def test_a_node_that_has_not_started_yet_is_not_settled():
    out = {"a": [(-INF, 0)], "d": [(-INF, 30)]}
    assert lv.settled_at(out, ("a", "d"), 25, 20) == ("a",)
    assert lv.settled_at(out, ("a", "d"), 51, 20) == ("a", "d")


def test_a_job_that_never_steps_again_is_owed_to_the_end():
    (v,) = lv.violations(_steps((0, 10)), {}, NODES, 0, 100, 2, 20)
    assert (v.start, v.length_s) == (30.0, 70.0)


def test_a_pause_that_begins_as_the_nodes_settle_may_still_take_the_bound():
    # b out 0-5: a and b settled from 25. A drain's restart pauses the job 24-36 (12 s, under
    # the 20 s bound): owed nothing (seen in the overlapping matrix: a violation from 1.5 s
    # into a 12 s pause, since the nodes had settled just then).
    steps = _steps((0, 24), (36, 60))
    assert lv.violations(steps, {"b": [(0, 5)]}, NODES, 0, 60, 2, 20) == []
    late = _steps((0, 24), (50, 60))       # ... but 26 s is owed from 44 (24 + 20) on
    (v,) = lv.violations(late, {"b": [(0, 5)]}, NODES, 0, 60, 2, 20)
    assert (v.start, v.length_s) == (44.0, 6.0)
