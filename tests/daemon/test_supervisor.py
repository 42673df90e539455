"""Every edge of the supervisor's pure decision function, one test each (no processes)."""

from __future__ import annotations

import pytest

from elasticd.supervisor import Action, Phase, Policy, View, decide

POLICY = Policy(backoff_initial_s=1.0, backoff_max_s=8.0, crash_loop_failures=3,
                crash_loop_window_s=100.0, completion_grace_s=30.0)


def d(**kw):
    kw.setdefault("now", 1000.0)
    kw.setdefault("phase", Phase.IDLE)
    return decide(View(**kw), POLICY)


def test_idle_starts_the_agent():
    out = d()
    assert (out.action, out.phase) == (Action.START_AGENT, Phase.RUNNING)
    assert out.reason == "starting the torchrun agent"


def test_running_agent_with_nothing_new_does_nothing():
    out = d(phase=Phase.RUNNING, agent_running=True)
    assert (out.action, out.phase) == (Action.NONE, Phase.RUNNING)


def test_agent_exit_zero_records_completion():
    out = d(phase=Phase.RUNNING, agent_exit=0)
    assert (out.action, out.phase) == (Action.RECORD_COMPLETED, Phase.COMPLETED)


def test_agent_failure_backs_off_exponentially():
    first = d(phase=Phase.RUNNING, agent_exit=1)
    assert (first.action, first.phase, first.delay_s) == (Action.BACKOFF, Phase.BACKOFF, 1.0)
    second = d(phase=Phase.RUNNING, agent_exit=1, failures=(990.0,))
    assert second.delay_s == 2.0
    assert "failure 2 of 3" in second.reason


def test_backoff_is_capped():
    policy = Policy(backoff_initial_s=1.0, backoff_max_s=3.0, crash_loop_failures=10)
    out = decide(View(now=1000.0, phase=Phase.RUNNING, agent_exit=1, failures=(995.0,) * 5), policy)
    assert out.delay_s == 3.0


def test_backoff_waits_until_its_delay_is_over():
    assert d(phase=Phase.BACKOFF, restart_at=1001.0).action is Action.NONE
    out = d(phase=Phase.BACKOFF, restart_at=999.0)
    assert (out.action, out.reason) == (Action.START_AGENT, "restarting the torchrun agent")


def test_crash_loop_marks_the_node_failed():
    out = d(phase=Phase.RUNNING, agent_exit=1, failures=(950.0, 990.0))
    assert (out.action, out.phase) == (Action.MARK_FAILED, Phase.FAILED)
    assert "failed 3 times without progress" in out.reason


def test_old_failures_outside_the_window_do_not_count():
    out = d(phase=Phase.RUNNING, agent_exit=1, failures=(100.0, 200.0))
    assert out.action is Action.BACKOFF


def test_dead_peer_while_running_evicts_and_restarts_workers():
    out = d(phase=Phase.RUNNING, agent_running=True, dead_peers=("b",))
    assert (out.action, out.phase, out.peers) == (Action.EVICT_PEERS, Phase.RUNNING, ("b",))
    assert out.reason.startswith("peer(s) b lost; evicting them")


def test_dead_peer_while_backing_off_is_still_evicted():
    out = d(phase=Phase.BACKOFF, restart_at=2000.0, dead_peers=("b", "c"))
    assert (out.action, out.phase) == (Action.EVICT_PEERS, Phase.BACKOFF)


def test_drain_request_starts_draining():
    out = d(phase=Phase.RUNNING, agent_running=True, drain_reason="SIGTERM was received")
    assert (out.action, out.phase) == (Action.DRAIN, Phase.DRAINING)
    assert out.reason == "draining because SIGTERM was received"


def test_draining_waits_for_the_agent_then_finishes():
    assert d(phase=Phase.DRAINING, agent_running=True, drain_reason="x").action is Action.NONE
    out = d(phase=Phase.DRAINING, drain_reason="x")
    assert (out.action, out.phase) == (Action.FINISH_DRAIN, Phase.STOPPED)


def test_drain_beats_an_agent_exit():
    out = d(phase=Phase.RUNNING, agent_exit=1, drain_reason="SIGTERM was received")
    assert out.action is Action.DRAIN


def test_job_completed_elsewhere_and_no_agent_completes():
    out = d(phase=Phase.BACKOFF, job_state="completed", restart_at=2000.0)
    assert (out.action, out.phase) == (Action.NONE, Phase.COMPLETED)


def test_agent_failure_after_completion_elsewhere_is_not_a_failure():
    out = d(phase=Phase.RUNNING, agent_exit=1, job_state="completed")
    assert (out.action, out.phase) == (Action.NONE, Phase.COMPLETED)


def test_agent_still_running_long_after_completion_is_stopped():
    waiting = d(phase=Phase.RUNNING, agent_running=True, job_state="completed", completed_seen_at=990.0)
    assert waiting.action is Action.NONE
    out = d(phase=Phase.RUNNING, agent_running=True, job_state="completed", completed_seen_at=900.0)
    assert (out.action, out.phase) == (Action.STOP_COMPLETED, Phase.COMPLETED)


def test_failed_job_does_not_start():
    out = d(job_state="failed")
    assert (out.action, out.phase) == (Action.NONE, Phase.FAILED)


@pytest.mark.parametrize("phase", [Phase.COMPLETED, Phase.FAILED, Phase.STOPPED])
def test_final_phases_do_nothing(phase):
    out = d(phase=phase, agent_exit=1, dead_peers=("b",), drain_reason="x")
    assert (out.action, out.phase) == (Action.NONE, phase)


def test_worker_crash_loop_while_running_marks_failed_and_stops():
    out = d(phase=Phase.RUNNING, agent_running=True, failures=(950.0, 980.0, 990.0))
    assert (out.action, out.phase) == (Action.MARK_FAILED, Phase.FAILED)
    assert "the workers crashed 3 times without progress" in out.reason


def test_worker_crashes_below_the_budget_are_tolerated():
    out = d(phase=Phase.RUNNING, agent_running=True, failures=(980.0, 990.0))
    assert out.action is Action.NONE


@pytest.mark.parametrize("now, last_change, event, cause", [
    (100.0, 95.0, "step", "membership"),       # a peer left or joined 5 s ago
    (100.0, 50.0, "stopped", "membership"),    # coordinated stop: a drain or scale change
    (100.0, 50.0, "step", "crash"),
    (100.0, float("-inf"), None, "crash"),
])
def test_restart_cause_tells_membership_from_crash(now, last_change, event, cause):
    from elasticd.supervisor import restart_cause
    assert restart_cause(now, last_change, event) == cause
