"""benchmarks/goodput.py's pure parts: the seeded trace and the goodput arithmetic.

No processes, no clocks: a trace is a function of its seed, a timeline is a list of dicts.
"""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import goodput as g


def removals(trace: list[g.Fault]) -> list[g.Fault]:
    return [f for f in trace if f.kind in g.REMOVALS]


def test_the_trace_is_a_function_of_its_seed() -> None:
    assert g.draw_trace(7, 600) == g.draw_trace(7, 600)
    assert g.draw_trace(7, 600) != g.draw_trace(8, 600)


def test_mean_time_between_failures_is_roughly_the_mtbf() -> None:
    # A long trace with nodes coming back fast: few deferrals, so the arrivals are the draw.
    trace = g.draw_trace(1, 200_000, mtbf_s=60, nodes=8, rejoin_after_s=5, silent_s=5)
    times = [f.t for f in removals(trace)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert len(gaps) > 2000
    assert 55 < statistics.mean(gaps) < 66
    # Exponential: the median gap is ln 2 x the mean, not the mean (a fixed period would fail).
    assert 0.6 < statistics.median(gaps) / statistics.mean(gaps) < 0.8


@pytest.mark.parametrize("seed", range(20))
def test_never_below_min_nodes_and_victims_are_in_the_job(seed: int) -> None:
    trace = g.draw_trace(seed, 3000, mtbf_s=20, rejoin_after_s=40, silent_s=30)
    assert all(count >= g.MIN_NODES for _, count in g.alive_over_trace(trace))
    in_job = {f"n{i}": float("-inf") for i in range(g.NODES)}
    for fault in trace:
        if fault.kind == "rejoin":
            assert fault.node not in in_job   # a fresh node
            in_job[fault.node] = fault.t
        else:
            assert fault.t - in_job.pop(fault.node) >= g.SETTLED_S
    assert [f.t for f in trace] == sorted(f.t for f in trace)


def test_every_removal_is_followed_by_a_rejoin_unless_near_the_end() -> None:
    duration = 1200
    trace = g.draw_trace(3, duration, rejoin_after_s=20, silent_s=30)
    # The i-th removal's fresh node is n{NODES + i}.
    rejoins = {f.node: f.t for f in trace if f.kind == "rejoin"}
    for i, fault in enumerate(removals(trace)):
        gone = fault.t + (30 if fault.kind == "silent" else 0)
        expected = gone + 20
        if expected <= duration - g.QUIET_TAIL_S / 2:
            assert rejoins.pop(f"n{g.NODES + i}") == pytest.approx(expected, abs=1e-3)
        else:
            assert f"n{g.NODES + i}" not in rejoins
    assert not rejoins
    assert all(g.WARMUP_S <= f.t <= duration - g.QUIET_TAIL_S for f in removals(trace))


def test_kinds_are_mixed_even_in_a_short_trace() -> None:
    for seed in range(10):
        kinds = [f.kind for f in removals(g.draw_trace(seed, 3000))]
        bags = [kinds[i:i + 4] for i in range(0, len(kinds) - 3, 4)]
        assert bags and all(sorted(b) == ["crash", "crash", "drain", "silent"] for b in bags)
        assert "rejoin" in {f.kind for f in g.draw_trace(seed, 3000)}


def test_actions_end_a_silent_node_with_a_kill() -> None:
    trace = [g.Fault(10.0, "silent", "n1"), g.Fault(20.0, "crash", "n2"), g.Fault(25.0, "drain", "n3"),
             g.Fault(60.0, "rejoin", "n4")]
    assert g.actions(trace, silent_s=30) == [
        (10.0, "stop", "n1"), (20.0, "kill", "n2"), (25.0, "term", "n3"), (40.0, "kill", "n1"),
        (60.0, "start", "n4")]


def rec(t: float, step: int, world: int = 4, event: str = "step") -> dict:
    return {"time": t, "step": step, "world_size": world, "event": event, "node": "n0"}


def steady(t0: float, t1: float, step0: int, world: int = 4, rate: float = 10.0) -> list[dict]:
    """Step records every 0.25 s at ``rate`` steps/s from ``step0`` at ``t0``."""
    out, t = [], t0
    while t <= t1 + 1e-9:
        out.append(rec(round(t, 3), step0 + round((t - t0) * rate), world))
        t += 0.25
    return out


def test_history_counts_redone_steps_once() -> None:
    # 0-30 s at 10 steps/s, a crash at 30 s, a restart resumes the checkpoint at 280 from 33 s.
    timeline = steady(0, 30, 0) + [rec(33.0, 280, 3, "resumed")] + steady(33.25, 60, 281, 3)
    assert g.history_at(timeline, 60) == timeline[-1]["step"] == 281 + round(26.75 * 10)
    # Steps 281-300 were done twice: the history holds them once. At 31 s the job held 300,
    # but the restart kept 280: the history at 31 s is 280; seen only up to 31 s, 300.
    assert g.history_at(timeline, 31) == 280
    assert g.history_at([r for r in timeline if r["time"] <= 31], 31) == 300


def test_a_rollback_just_after_the_end_lowers_the_history() -> None:
    timeline = steady(0, 30, 0) + [rec(32.0, 280, 3, "resumed")] + steady(32.25, 40, 281, 3)
    assert g.history_at(timeline, 30.5) == 280    # held 300 at the end, kept 280
    assert g.history_at(timeline, -1) is None


def test_goodput_of_a_synthetic_run() -> None:
    ref = steady(0, 100, 0, rate=10)
    rate = g.step_rate(ref)
    assert rate == pytest.approx(10, rel=0.01)
    # 60 s window, a 3 s pause at 30 s that also rolled back 20 steps.
    timeline = steady(0, 30, 0) + [rec(33.0, 280, 3, "resumed")] + steady(33.25, 60, 281, 3)
    useful = g.history_at(timeline, 60)
    assert g.goodput(useful, rate, 60) == pytest.approx(useful / 600, rel=0.01)
    assert 0.9 < g.goodput(useful, rate, 60) < 0.93   # 548 of 600
    assert g.pauses(timeline, 0, 60) == pytest.approx(3.25)   # last step 30.0, next 33.25
    # A gap across the window's end counts up to the end; a job that never steps again too.
    assert g.pauses(timeline, 0, 31) == pytest.approx(1.0)
    assert g.pauses(steady(0, 30, 0), 0, 50) == pytest.approx(20.0)


def test_history_worlds_weights_each_kept_step_by_its_world() -> None:
    # 300 steps at 4, a crash and a resume of step 280 at world 3, then 3 until 60 s.
    timeline = steady(0, 30, 0) + [rec(33.0, 280, 3, "resumed")] + steady(33.25, 60, 281, 3)
    worlds = g.history_worlds(timeline, 60)
    assert len(worlds) == g.history_at(timeline, 60)
    assert worlds[:280] == [4] * 280 and set(worlds[280:]) == {3}   # 281-300 redone at 3
    # The end-of-window rollback applies here too: held 300 at 30.5 s, kept 280.
    assert g.history_worlds(timeline, 30.5) == [4] * 280
    assert g.history_worlds(timeline, -1) == []


def test_a_newcomers_warm_record_is_not_a_rollback_of_the_history() -> None:
    # A loss re-forms 4 -> 3 after step 150; a join in place: the newcomer's worker says
    # "warm" at step 0 in a world of its own while the world of 3 trains; the world of 4
    # re-forms after step 300 and goes on.
    timeline = (steady(0, 15, 0) + [rec(15.1, 150, 3, "reformed")] + steady(15.25, 30, 152, world=3)
                + [rec(29.0, 0, 1, "warm"), rec(30.1, 300, 4, "reformed")] + steady(30.25, 60, 302))
    timeline.sort(key=lambda r: r["time"])
    worlds = g.history_worlds(timeline, 60)
    assert len(worlds) == g.history_at(timeline, 60) == timeline[-1]["step"]
    assert worlds[:150] == [4] * 150 and set(worlds[150:300]) == {3} and set(worlds[300:]) == {4}
    # A warm record just after the end is no rollback either.
    assert g.history_at(timeline + [rec(61.0, 0, 1, "warm")], 60) == timeline[-1]["step"]


def test_sample_goodput_counts_a_smaller_world_as_less_training() -> None:
    # Steps at the fault-free rate but on 2 of 4 nodes: every step, half the samples.
    half = steady(0, 60, 0, world=2)
    useful = g.history_at(half, 60)
    assert g.goodput(useful, 10, 60) == pytest.approx(1.0, rel=0.01)
    assert g.sample_goodput(sum(g.history_worlds(half, 60)), 10, 60) == pytest.approx(0.5, rel=0.01)


def test_available_node_seconds_follows_removals_and_starts() -> None:
    sent = [{"t": 10.0, "action": "kill", "node": "n1"},     # 4 -> 3
            {"t": 20.0, "action": "stop", "node": "n2"},     # 3 -> 2 (frozen trains nothing)
            {"t": 30.0, "action": "start", "node": "n4"},    # 2 -> 3
            {"t": 50.0, "action": "kill", "node": "n2"},     # the frozen node's end: still 3
            {"t": 70.0, "action": "term", "node": "n0"}]     # after the window: not counted
    assert g.available_node_seconds(sent, 60, nodes=4) == 4 * 10 + 3 * 10 + 2 * 10 + 3 * 30
    assert g.available_node_seconds([], 60, nodes=4) == 240


def test_event_outcome_in_place_and_restart() -> None:
    inplace = steady(0, 30, 0) + [rec(30.6, 300, 3, "reformed")] + steady(30.75, 40, 301, 3)
    out = g.event_outcome(inplace, 30.1)
    assert out["path"] == "in-place" and out["steps_lost"] == 0 and out["new_world"] == 3
    assert out["recovery_s"] == pytest.approx(0.65) and out["pause_s"] == pytest.approx(0.75)
    restart = steady(0, 30, 0) + [rec(33.0, 280, 3, "resumed")] + steady(33.25, 40, 281, 3)
    out = g.event_outcome(restart, 30.1)
    assert out["path"] == "restart" and out["steps_lost"] == 20 and out["continued_from"] == 280
    # No world of another size after the event: not recovered (a stalled job).
    assert g.event_outcome(steady(0, 30, 0), 10)["recovered"] is False
    # The new world came after the next event: it is that event's, not this one's.
    late = g.event_outcome(restart, 30.1, t_next=32.0)
    assert late["recovered"] is False and "next event" in late["note"]


def test_bursts_of_log_lines_count_once() -> None:
    events = [("n0", 10.0, 5), ("n1", 10.4, 5), ("n2", 11.0, 5), ("n0", 40.0, 9)]
    assert g.clusters_of(events) == 2


def test_out_intervals_follow_the_actions_sent() -> None:
    sent = [{"t": 10.0, "action": "stop", "node": "n1"}, {"t": 40.0, "action": "kill", "node": "n1"},
            {"t": 60.0, "action": "start", "node": "n4"}, {"t": 70.0, "action": "term", "node": "n2"}]
    out = g.out_intervals(sent)
    assert out["n0"] == [] and out["n3"] == []
    assert out["n1"] == [(10.0, float("inf"))]      # frozen, then killed: out from the freeze
    assert out["n4"] == [(float("-inf"), 60.0)] and out["n2"] == [(70.0, float("inf"))]


def test_liveness_of_a_stalled_trace_names_the_pause_and_the_actions_behind_it() -> None:
    t0 = 1000.0
    steps = [{"event": "step", "time": t0 + i * 0.1, "step": i} for i in range(1, 300)]
    steps += [{"event": "step", "time": t0 + 100 + i * 0.1, "step": 300 + i} for i in range(100)]
    sent = [{"t": 25.0, "action": "term", "node": "n3"}, {"t": 26.0, "action": "stop", "node": "n0"}]
    got = g.liveness_of(steps, sent, t0, t0 + 110)
    assert got["longest_pause_s"] == pytest.approx(70.1, abs=0.01)
    assert got["longest_pause_after"] == ["term n3 at 25.0", "stop n0 at 26.0"]
    (v,) = got["liveness_violations"]          # n1 and n2 stayed: owed from 29.9 + 20 s
    assert v["nodes"] == ["n1", "n2"] and v["at_s"] == pytest.approx(49.9, abs=0.01)
    healthy = g.liveness_of(steps[:299] + [{"event": "step", "time": t0 + 38, "step": 300}], sent,
                            t0, t0 + 38)
    assert healthy["liveness_violations"] == [] and healthy["longest_pause_s"] < 10


def test_across_seeds_tabulates_each_reports_liveness() -> None:
    report = json.loads((g.REPO / "benchmarks" / "results" / "goodput-liveness-seed5.json").read_text())
    table, text = g.across_seeds([report])
    (row,) = table["rows"]
    assert row["seed"] == 5 and row["survived"] and row["violations"] == 0
    assert row["pause_met"] == (row["longest_pause_s"] <= g.PAUSE_TARGET_S)
    assert "| 5 | elasticd, in-place | 420 | yes |" in text
