"""Every rule of the daemon's pure decision function, one test each (no processes, no clock).

``decide(snapshot, memory, policy)`` returns the next memory, the actions and one
sentence; the tests drive it with hand-built snapshots, timers included.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from elasticd import supervisor
from elasticd.contract.generation import GenerationId, GenerationRecord, WorldView, renumber
from elasticd.contract.progress import Reform
from elasticd.contract.settings import IN_PLACE, RESTART
from elasticd.inplace.agreement import ShrinkOutcome
from elasticd.supervisor import (
    PHASE_EDGES,
    Death,
    Eviction,
    IllegalPhaseChange,
    InPlace,
    Kind,
    Memory,
    PeerView,
    Phase,
    Policy,
    Snapshot,
    change_phase,
    decide,
    drain_grace,
    gone_members,
    hang_bound,
    records_loss,
    records_recovery,
    restart_cause,
)
from elasticd.supervisor.reform import IN_PLACE_SLACK_S

POLICY = Policy(backoff_initial_s=1.0, backoff_max_s=8.0, crash_loop_failures=3,
                crash_loop_window_s=100.0, completion_grace_s=30.0, kill_grace_s=2.0,
                confirm_timeout_s=1.5, drain_grace_s=60.0, notice_margin_s=5.0,
                hang_floor_s=10.0, hang_factor=20.0, recovery_mode=RESTART)
T = 1000.0
AGENT = 4242
W = frozenset({11, 12})
RUNNING = Memory.of(phase=Phase.RUNNING, workers=W, agent_pid=AGENT)
B = PeerView("b", "running", ("127.0.0.1", 77), 5, "127.0.0.1:9")


def snap(**kw) -> Snapshot:
    kw.setdefault("now", T)
    return Snapshot(**kw)


def live(**kw) -> Snapshot:
    """A running agent with its workers."""
    kw.setdefault("agent_pid", AGENT)
    kw.setdefault("workers", W)
    return snap(**kw)


def d(s: Snapshot, m: Memory = RUNNING, policy: Policy = POLICY):
    return decide(s, m, policy)


# -- start, exit, backoff, crash loop ---------------------------------------------------

def test_idle_starts_the_agent_and_reports_ready_once():
    out = d(snap(), Memory.of())
    assert out.phase is Phase.RUNNING
    assert out.kinds() == [Kind.START_AGENT, Kind.NOTIFY]
    assert out.reason == "starting the torchrun agent"
    again = d(snap(now=T + 5), replace(out.memory, phase=Phase.BACKOFF))
    assert again.kinds() == [Kind.START_AGENT]


def test_a_start_waits_for_the_warm_servers_imports_saying_so_once_then_starts():
    # Forked by the server the agent skips its own import of torch (elasticd.agent).
    waiting = d(snap(warm_server="importing", warm_server_age_s=3.0), Memory.of())
    assert (waiting.actions, waiting.phase) == ((), Phase.IDLE)
    assert waiting.reason == ("waiting for the warm-start server's imports (3.0 s in) to "
                              "start the torchrun agent there")
    quiet = d(snap(warm_server="importing", warm_server_age_s=4.0), waiting.memory)
    assert (quiet.actions, quiet.reason) == ((), "")
    ready = d(snap(warm_server="ready", warm_server_age_s=5.0), quiet.memory)
    assert ready.kinds() == [Kind.START_AGENT, Kind.NOTIFY]
    assert not ready.memory.life.warm_wait_said


@pytest.mark.parametrize("state, age", [("importing", 20.0), ("dead", 1.0), ("off", 0.0)])
def test_a_start_does_not_wait_for_a_warm_server_past_its_bound_or_dead(state, age):
    out = d(snap(warm_server=state, warm_server_age_s=age), Memory.of(),
            replace(POLICY, warm_agent_wait_s=20.0))
    assert out.kinds() == [Kind.START_AGENT, Kind.NOTIFY]


def test_running_agent_with_nothing_new_does_nothing():
    out = d(live())
    assert (out.actions, out.phase, out.reason) == ((), Phase.RUNNING, "")


def test_agent_exit_zero_records_completion():
    out = d(snap(agent_pid=AGENT, agent_exit=0, step=50))
    assert out.phase is Phase.COMPLETED
    assert out.kinds() == [Kind.MARK_COMPLETED, Kind.PUBLISH, Kind.JOURNAL]


def test_agent_failure_backs_off_exponentially():
    first = d(snap(agent_pid=AGENT, agent_exit=1))
    assert first.phase is Phase.BACKOFF and first.memory.life.restart_at == T + 1.0
    second = d(snap(agent_pid=AGENT, agent_exit=1), RUNNING.but(failures=(990.0,)))
    assert second.memory.life.restart_at == T + 2.0
    assert "failure 2 of 3" in second.reason


def test_an_exit_is_handled_once():
    first = d(snap(agent_pid=AGENT, agent_exit=1))
    again = d(snap(now=T + 0.1, agent_pid=AGENT, agent_exit=1), first.memory)
    assert again.actions == () and again.phase is Phase.BACKOFF


def test_backoff_is_capped():
    policy = replace(POLICY, backoff_max_s=3.0, crash_loop_failures=10)
    out = d(snap(agent_pid=AGENT, agent_exit=1), RUNNING.but(failures=(995.0,) * 5), policy)
    assert out.memory.life.restart_at == T + 3.0


def test_backoff_waits_until_its_delay_is_over():
    waiting = Memory.of(phase=Phase.BACKOFF, restart_at=T + 1, exit_handled=True, ready_sent=True)
    assert d(snap(agent_pid=AGENT, agent_exit=1), waiting).actions == ()
    out = d(snap(now=T + 1, agent_pid=AGENT, agent_exit=1), waiting)
    assert (out.kinds(), out.reason) == ([Kind.START_AGENT], "restarting the torchrun agent")


def test_crash_loop_marks_the_node_failed():
    out = d(snap(agent_pid=AGENT, agent_exit=1), RUNNING.but(failures=(950.0, 990.0)))
    assert out.phase is Phase.FAILED
    assert "failed 3 times without progress" in out.reason
    assert out.actions[0].kind is Kind.PUBLISH and out.actions[0]["fields"]["state"] == "failed"


def test_old_failures_outside_the_window_do_not_count():
    out = d(snap(agent_pid=AGENT, agent_exit=1), RUNNING.but(failures=(100.0, 200.0)))
    assert out.phase is Phase.BACKOFF


def test_worker_crash_loop_while_running_marks_failed():
    out = d(live(), RUNNING.but(failures=(950.0, 980.0, 990.0)))
    assert out.phase is Phase.FAILED
    assert "the workers crashed 3 times without progress" in out.reason


@pytest.mark.parametrize("failing", ["agent", "workers"])
def test_a_node_marked_failed_says_its_workers_last_error_in_the_sentence_record_and_journal(failing):
    """Before: "... 5 times without progress ...; marking this node failed", the cause
    only in agent.log (often a temp directory)."""
    error = "RuntimeError: Distributed package doesn't have NCCL built in"
    s = (snap(agent_pid=AGENT, agent_exit=1, worker_error=error) if failing == "agent"
         else live(worker_error=error))
    out = d(s, RUNNING.but(failures=(950.0, 980.0, 990.0)))
    assert out.phase is Phase.FAILED and out.reason.endswith(f"; the workers' last error: {error}")
    publish, journal = out.actions
    assert publish["fields"]["reason"] == out.reason
    assert journal["event"] == "node-failed" and journal["fields"]["last_error"] == error
    plain = d(replace(s, worker_error=None), RUNNING.but(failures=(950.0, 980.0, 990.0)))
    assert plain.reason.endswith("marking this node failed")
    assert "last_error" not in plain.actions[1]["fields"]


def test_worker_crashes_below_the_budget_are_tolerated():
    assert d(live(), RUNNING.but(failures=(980.0, 990.0))).phase is Phase.RUNNING


def test_progress_past_the_last_failures_high_water_mark_clears_the_crash_count():
    mem = RUNNING.but(failures=(990.0,), high_water=10, failed_at_mark=10, step=10)
    out = d(live(step=11), mem)
    assert out.memory.life.failures == () and "crash count is reset" in out.reason
    assert out.memory.life.high_water == 11
    assert d(live(step=10), mem.but(step=9)).memory.life.failures == (990.0,)


def test_steps_redone_after_a_resume_do_not_clear_the_crash_count():
    # A restart resumed the checkpoint of step 1100 after a failure at 1240: steps up
    # to 1240 are redone ground, not progress (the goodput run's diverging job cleared
    # its count on every resume and restarted 18 times).
    mem = RUNNING.but(failures=(990.0,), high_water=1240, failed_at_mark=1240, step=1100)
    out = d(live(step=1230), mem)
    assert out.memory.life.failures == (990.0,) and "reset" not in out.reason
    assert out.memory.life.high_water == 1240


def test_a_crash_loop_at_the_same_step_ends_in_failed():
    """Fail at step 40, resume from 20, step to 40, fail again: the budget's last marks FAILED."""
    budget, now = POLICY.crash_loop_failures, T
    started = d(snap(step=0), Memory.of())   # the agent starts at step 0 ...
    assert started.kinds()[0] is Kind.START_AGENT
    mem = d(live(step=0), started.memory).memory
    for step in (20, 40):                 # ... and its first workers reach step 40
        mem = d(live(step=step), mem).memory
    for count in range(1, budget + 1):
        out = d(live(now=now, step=20, workers=frozenset({100 + count})), mem)
        mem = out.memory
        assert len(mem.life.failures) == count and mem.life.failed_at_mark == 40
        if count == budget:
            break
        for step in (30, 40):
            now += 1.0
            mem = d(live(now=now, step=step, workers=frozenset({100 + count})), mem).memory
        now += 1.0
    assert out.phase is Phase.FAILED, out.reason
    assert f"crashed {budget} times without progress" in out.reason


# -- worker restarts and their cause ------------------------------------------------------

@pytest.mark.parametrize("now, changed, event, cause", [
    (100.0, 95.0, "step", "membership"),       # a peer left or joined 5 s ago
    (100.0, 50.0, "stopped", "membership"),    # coordinated stop: a drain or scale change
    (100.0, 50.0, "peer-unfit", "membership"),  # a peer node could not resume: its fault
    (100.0, 50.0, "step", "crash"),
    (100.0, float("-inf"), None, "crash"),
])
def test_restart_cause_tells_membership_from_crash(now, changed, event, cause):
    assert restart_cause(now, changed, event, window_s=15.0) == cause


def test_a_new_worker_group_after_a_crash_counts_a_failure():
    out = d(live(workers=frozenset({21})))
    assert out.memory.life.failures == (T,)
    assert out.reason == "the agent restarted its workers after a crash"
    journal = out.actions[0]
    assert (journal.kind, journal["fields"]) == (Kind.JOURNAL, {"cause": "crash"})
    assert out.actions[1]["label"] == "crash"


def test_a_worker_group_torch_restarted_without_counting_it_is_a_membership_restart():
    """CI: c's agent joined a moment after a and b's first round closed; their agents
    restarted the workers for the bigger round, and with no record of ours saying a peer
    joined, both daemons counted a crash. torch's TORCHELASTIC_RESTART_COUNT is the
    verdict: it grows for a failure only."""
    counted = RUNNING.but(workers_restart_count=0)
    out = d(live(workers=frozenset({21}), workers_restart_count=0), counted)
    assert out.memory.life.failures == () and out.reason.endswith("after a membership change")
    assert out.memory.life.workers_restart_count == 0
    crash = d(live(workers=frozenset({21}), workers_restart_count=1), counted)
    assert crash.memory.life.failures == (T,) and crash.reason.endswith("after a crash")
    unread = d(live(workers=frozenset({21}), workers_restart_count=None), counted)
    assert unread.memory.life.failures == (T,)   # no verdict read: the other signals decide


def test_a_new_worker_group_after_a_membership_change_is_not_a_failure():
    out = d(live(workers=frozenset({21})), RUNNING.but(membership_changed_at=T - 3))
    assert out.memory.life.failures == () and "after a membership" in out.reason


def test_the_first_worker_group_of_an_agent_is_not_a_restart():
    out = d(live(), RUNNING.but(workers=frozenset()))
    assert out.actions == () and out.memory.life.workers == W


# -- peers: refused, vanished, confirmed, evicted, killed -------------------------------

C = PeerView("c", "running", ("127.0.0.3", 78), 6, "127.0.0.3:9")
PEERS = {"b": B, "c": C}


def test_a_refused_probe_is_a_suspicion_published_in_the_record_not_a_death():
    out = d(live(node_id="a", peers=PEERS, refused=(B,)))
    assert [(a.kind, a["fields"]) for a in out.actions] == [(Kind.PUBLISH, {"suspects": ["b"]})]
    assert out.reason == "peer b refused its liveness probe"
    assert not out.memory.peer.dead and out.memory.peer.suspicions["b"] == ("crashed", T)
    again = d(live(node_id="a", now=T + 0.5, peers=PEERS, refused=(B,)), out.memory)
    assert again.actions == ()                       # published once


def test_a_peer_a_majority_suspects_is_condemned_once():
    mine = d(live(node_id="a", peers=PEERS, refused=(B,))).memory
    c_too = {"b": B, "c": replace(C, suspects=frozenset({"b"}))}
    out = d(live(node_id="a", now=T + 0.1, peers=c_too), mine)
    assert out.kinds()[0] is Kind.EVICT and out.memory.peer.evicting["b"].how == "crashed"
    assert "a majority of the members suspect peer b" in out.reason
    later = d(live(node_id="a", now=T + 0.2, peers=c_too), out.memory)
    assert Kind.EVICT not in later.kinds()
    # Its lease expires later: etcd's verdict on the same death is not a second eviction.
    gone = d(live(node_id="a", now=T + 5, peers={"c": C}, departed=(B,)), later.memory)
    assert Kind.EVICT not in gone.kinds() and Kind.CONFIRM_PEER not in gone.kinds()


def _condemn_b() -> Memory:
    """a and c suspect b (b's agent 77): condemned, evicted."""
    mine = d(live(node_id="a", peers=PEERS, refused=(B,))).memory
    c_too = {"b": B, "c": replace(C, suspects=frozenset({"b"}))}
    return d(live(node_id="a", now=T + 0.1, peers=c_too), mine).memory


def test_a_verdict_holds_while_the_record_names_the_condemned_agent():
    mem = _condemn_b()
    assert mem.peer.condemned == {"b": B.agent}
    # The probes answer again (a dropped link healed) but the record is the old one.
    again = d(live(node_id="a", now=T + 1, peers=PEERS, probe_answers={"b": "alive"}), mem)
    assert again.memory.peer.condemned == {"b": B.agent} and Kind.EVICT not in again.kinds()


def test_a_condemned_node_restarted_before_its_lease_ran_out_is_a_new_member():
    """The demo's rejoin in CI: node-c, SIGKILLed and restarted at once, overwrote its
    record before the old lease expired; the verdict on it lived as long as the key, so
    the survivors took every round it joined as naming a gone agent."""
    mem = _condemn_b()
    back = replace(B, agent=("127.0.0.1", 5151), mod_revision=20,
                   probe="127.0.0.1:10")
    # Still suspected (no answer from its new daemon yet): held, and not a second death.
    suspected = {"b": back, "c": replace(C, suspects=frozenset({"b"}))}
    held = d(live(node_id="a", now=T + 1, peers=suspected), mem)
    assert held.memory.peer.condemned == {"b": B.agent} and Kind.EVICT not in held.kinds()
    # Its new agent is live all the same: a round naming it is not broken.
    s = _forming(now=T + 1, members=(MINE, back.agent), peers={"b": back})
    assert gone_members(s, held.memory) == frozenset()
    # It answers: the verdict is lifted.
    answered = d(live(node_id="a", now=T + 2, peers={"b": back, "c": C},
                      probe_answers={"b": "alive"}), held.memory)
    assert answered.memory.peer.condemned == {} and answered.memory.peer.suspicions == {}
    # Crashed again (the first eviction long done), it is condemned again.
    again = d(live(node_id="a", now=T + 3, peers={"b": back, "c": C}, refused=(back,)),
              answered.memory.but(evicting={}, dead={}))
    twice = d(live(node_id="a", now=T + 3.1, peers={"b": back, "c": replace(
        C, suspects=frozenset({"b"}))}), again.memory)
    assert twice.memory.peer.condemned == {"b": back.agent} and Kind.EVICT in twice.kinds()
    assert "a majority of the members suspect peer b" in twice.reason


def test_a_minority_of_one_suspicion_condemns_nobody():
    out = d(live(node_id="a", peers=PEERS, refused=(B,)))
    assert not out.memory.peer.dead and out.memory.peer.isolated_since is None


def test_a_node_cut_off_from_the_majority_evicts_nobody_and_stops_its_workers():
    """Issue 29 finding 4: behind a REJECT cut, c took its refused probes as deaths and
    fenced the healthy two out of the job."""
    a = PeerView("a", "running", ("127.0.0.1", 76), 4, "127.0.0.1:9")
    peers = {"a": a, "b": B}
    out = d(live(node_id="c", peers=peers, refused=(a, B)), RUNNING)
    assert Kind.EVICT not in out.kinds() and Kind.SHRINK not in out.kinds()
    assert Kind.KILL_AGENT in out.kinds() and out.memory.peer.isolated_since == T
    assert "cut off from the majority" in out.reason
    exited = d(live(node_id="c", now=T + 1, peers=peers, agent_exit=-9), out.memory)
    assert exited.memory.life.failures == () and exited.phase is Phase.BACKOFF
    # torchrun killed that way can exit 0 (seen in a partition run): not the job's completion.
    zero = d(live(node_id="c", now=T + 1, peers=peers, agent_exit=0), out.memory)
    assert zero.phase is Phase.BACKOFF and Kind.MARK_COMPLETED not in zero.kinds()
    held = d(snap(node_id="c", now=T + 30, peers=peers, agent_pid=AGENT, agent_exit=-9),
             exited.memory)
    assert Kind.START_AGENT not in held.kinds()
    back = d(snap(node_id="c", now=T + 31, peers=peers, agent_pid=AGENT, agent_exit=-9,
                  probe_answers={"a": "alive", "b": "alive"}), held.memory)
    assert back.memory.peer.isolated_since is None and Kind.START_AGENT in back.kinds()


def test_a_silent_peer_is_suspected_after_the_bound_and_an_answer_clears_it():
    p = replace(POLICY, silent_suspect_s=5.0)
    first = d(live(node_id="a", peers=PEERS, probe_answers={"b": "silent"}), RUNNING, p)
    assert not first.memory.peer.suspicions and first.memory.peer.silent_since == {"b": T}
    later = d(live(node_id="a", now=T + 5, peers=PEERS, probe_answers={"b": "silent"}),
              first.memory, p)
    assert later.memory.peer.suspicions["b"][0] == "silent"
    assert "peer b has not answered its probes" in later.reason
    cleared = d(live(node_id="a", now=T + 6, peers=PEERS, probe_answers={"b": "alive"}),
                later.memory, p)
    assert not cleared.memory.peer.suspicions and not cleared.memory.peer.silent_since
    assert [(a.kind, a["fields"]) for a in cleared.actions] == [(Kind.PUBLISH, {"suspects": []})]


def test_a_vanished_peer_is_confirmed_off_the_loop():
    out = d(live(departed=(B,)))
    assert out.kinds() == [Kind.CONFIRM_PEER]
    assert "b" in out.memory.peer.suspects and out.memory.peer.membership_changed_at == T


@pytest.mark.parametrize("answer, how", [("refused", "crashed"), ("silent", "silent")])
def test_a_confirmation_classifies_the_death_and_evicts(answer, how):
    suspect = d(live(departed=(B,))).memory
    out = d(live(now=T + 0.2, confirmations={"b": answer}), suspect)
    assert out.kinds()[:2] == [Kind.EVICT, Kind.JOURNAL]
    assert out.actions[1]["fields"] == {"peer": "b", "how": how}
    assert out.memory.peer.evicting["b"].how == how
    assert out.reason.startswith("peer(s) b lost; evicting them")


def test_a_vanished_peer_that_just_refused_its_probe_is_a_crash_at_once():
    refused = d(live(refused=(B,))).memory
    out = d(live(now=T + 0.3, departed=(B,)), refused)
    assert out.kinds()[0] is Kind.EVICT and out.memory.peer.evicting["b"].how == "crashed"
    stale = d(live(now=T + 2.5, departed=(B,)), refused)
    assert stale.kinds() == [Kind.CONFIRM_PEER]


def test_the_phase_decision_leads_the_sentence():
    refused = d(live(node_id="a", peers=PEERS, refused=(B,))).memory
    out = d(live(node_id="a", now=T + 0.3, peers={"c": C}, departed=(B,), refused=(B,),
                 probe_answers={"c": "refused"}), refused)
    assert out.reason.startswith("peer(s) b lost; evicting them")
    assert out.reason.endswith("peer c refused its liveness probe")


def test_a_vanished_peer_that_answers_is_left_alone():
    suspect = d(live(departed=(B,))).memory
    out = d(live(now=T + 0.2, confirmations={"b": "alive"}), suspect)
    assert out.actions == () and not out.memory.peer.dead
    assert "answers; waiting for it to re-register" in out.reason


def test_no_confirmation_within_the_timeout_means_silent():
    suspect = d(live(departed=(B,))).memory
    assert d(live(now=T + 1.0), suspect).actions == ()
    out = d(live(now=T + 1.5), suspect)
    assert out.memory.peer.evicting["b"].how == "silent"


def test_a_peer_that_left_needs_no_confirmation():
    out = d(live(departed=(replace(B, state="leaving"),)))
    assert out.kinds()[0] is Kind.EVICT and out.memory.peer.evicting["b"].how == "left"


def test_a_crashed_peer_in_our_round_gets_a_kill_grace():
    mem = RUNNING.but(evicting={"b": Death(B, "crashed", 1)})
    out = d(live(eviction=Eviction(("b",), ok=True, in_round=True)), mem)
    assert out.actions == () and (out.memory.peer.kill_at, out.memory.peer.kill_pids) == (T + 2.0, W)
    assert d(live(now=T + 1.9), out.memory).actions == ()
    due = d(live(now=T + 2.0), out.memory)
    assert [(a.kind, a["pids"]) for a in due.actions] == [(Kind.KILL_WORKERS, W)]
    assert due.memory.peer.kill_at is None


def test_workers_that_failed_by_themselves_are_not_killed_after_the_grace():
    mem = RUNNING.but(kill_at=T, kill_pids=W)
    out = d(live(workers=frozenset({31})), mem)
    assert Kind.KILL_WORKERS not in out.kinds() and out.memory.peer.kill_at is None


def test_a_silent_peer_in_our_round_kills_our_workers_now():
    mem = RUNNING.but(evicting={"b": Death(B, "silent", 1)})
    out = d(live(eviction=Eviction(("b",), ok=True, in_round=True)), mem)
    assert [(a.kind, a["pids"]) for a in out.actions] == [(Kind.KILL_WORKERS, W)]


def test_a_peer_outside_our_round_kills_nothing():
    mem = RUNNING.but(evicting={"b": Death(B, "silent", 1)})
    out = d(live(eviction=Eviction(("b",), ok=True, in_round=False)), mem)
    assert out.actions == () and out.memory.peer.kill_at is None


def test_another_daemon_evicted_first_so_the_record_decides():
    mem = RUNNING.but(evicting={"b": Death(B, "silent", 1)})
    out = d(live(eviction=Eviction(("b",), ok=True, in_round=None)), mem)
    assert out.kinds() == [Kind.KILL_WORKERS]


def test_a_failed_eviction_is_retried_without_journaling_again():
    mem = RUNNING.but(evicting={"b": Death(B, "crashed", 1)})
    out = d(live(eviction=Eviction(("b",), ok=False)), mem)
    assert out.memory.peer.dead["b"].attempts == 1 and out.memory.peer.kill_at == T + 2.0
    assert d(live(now=T + 0.5), out.memory).kinds() == []
    retry = d(live(now=T + 1.0), out.memory)
    assert retry.kinds() == [Kind.EVICT]
    assert retry.reason == "retrying the eviction of peer(s) b"


def test_a_retried_eviction_never_plans_a_second_kill():
    mem = RUNNING.but(evicting={"b": Death(B, "crashed", 2)})
    out = d(live(eviction=Eviction(("b",), ok=True, in_round=True)), mem)
    assert out.memory.peer.kill_at is None and out.actions == ()


def test_dead_peer_while_backing_off_is_still_evicted():
    mem = Memory.of(phase=Phase.BACKOFF, restart_at=T + 100, dead={"b": Death(B, "crashed")})
    out = d(snap(), mem)
    assert out.kinds()[0] is Kind.EVICT and out.phase is Phase.BACKOFF


def test_a_new_peer_is_a_membership_change():
    out = d(live(peers={"b": B}))
    assert out.memory.peer.membership_changed_at == T and out.memory.peer.peers_seen == {"b"}


# -- drain, notices, signals --------------------------------------------------------------

def test_drain_request_starts_draining():
    out = d(live(drain_request="SIGTERM was received", stop_signals=1))
    assert out.phase is Phase.DRAINING and out.memory.life.drain_deadline == T + 60.0
    assert out.kinds() == [Kind.PUBLISH, Kind.JOURNAL, Kind.NOTIFY, Kind.TOUCH_STOP_FILE,
                           Kind.TERMINATE_AGENT]
    assert out.actions[0]["fields"] == {"state": "leaving"}
    assert out.reason == "draining because SIGTERM was received (grace 60 s, by a coordinated stop)"


def test_a_notice_deadline_shortens_the_drain_grace():
    assert drain_grace(T, POLICY, T + 30.0) == 25.0
    assert drain_grace(T, POLICY, T + 300.0) == 60.0
    assert drain_grace(T, POLICY, None) == 60.0
    assert drain_grace(T, POLICY, T + 2.0) == 1.0
    out = d(live(drain_request="a gce preemption notice arrived", notice_deadline=T + 30.0))
    assert out.memory.life.drain_deadline == T + 25.0


def test_the_first_signal_after_a_notice_keeps_draining():
    draining = d(live(drain_request="a notice", notice_deadline=T + 30.0)).memory
    out = d(live(now=T + 1, drain_request="a notice", stop_signals=1), draining)
    assert out.phase is Phase.DRAINING and not out.memory.life.hard_stop


def test_a_second_signal_is_a_hard_stop():
    draining = d(live(drain_request="SIGTERM was received", stop_signals=1)).memory
    out = d(live(now=T + 1, drain_request="SIGTERM was received", stop_signals=2), draining)
    assert (out.phase, out.kinds(), out.memory.life.hard_stop) == (Phase.STOPPED, [Kind.KILL_AGENT], True)


def test_draining_leaves_the_rendezvous_once_the_workers_are_gone():
    draining = d(live(drain_request="x")).memory
    assert d(live(now=T + 1, drain_request="x"), draining).actions == ()
    out = d(live(now=T + 2, drain_request="x", workers=frozenset()), draining)
    assert out.kinds() == [Kind.LEAVE_RENDEZVOUS] and out.memory.life.left_rdzv


def test_draining_kills_the_agent_when_the_grace_is_over():
    draining = d(live(drain_request="x")).memory
    out = d(live(now=T + 60, drain_request="x"), draining)
    assert out.kinds() == [Kind.KILL_AGENT] and "grace is over" in out.reason


def test_draining_finishes_when_the_agent_is_gone():
    draining = d(live(drain_request="x")).memory.but(left_rdzv=True)
    out = d(snap(agent_pid=AGENT, agent_exit=75, drain_request="x", step=40), draining)
    assert out.phase is Phase.STOPPED
    assert out.kinds() == [Kind.JOURNAL, Kind.DELETE_DRAIN_KEY, Kind.OBSERVE]
    assert out.actions[0]["fields"] == {"step": 40, "drain_s": 0.0, "in_place": False}
    assert out.actions[2]["label"] == "coordinated-stop"
    not_left = d(snap(agent_pid=AGENT, agent_exit=75, drain_request="x"), draining.but(left_rdzv=False))
    assert not_left.kinds()[0] is Kind.LEAVE_RENDEZVOUS


def test_drain_beats_an_agent_exit():
    out = d(snap(agent_pid=AGENT, agent_exit=1, drain_request="SIGTERM was received"))
    assert out.phase is Phase.DRAINING


# -- job completion, rendezvous closed ----------------------------------------------------

def test_job_completed_elsewhere_and_no_agent_completes():
    out = d(snap(job_state="completed"), Memory.of(phase=Phase.BACKOFF, restart_at=T + 100))
    assert (out.actions, out.phase) == ((), Phase.COMPLETED)


def test_a_daemon_started_on_a_completed_job_starts_nothing():
    """What the last line of a completed job tells the operator (daemon.next_run_hint):
    the same job id again stops at once."""
    out = d(snap(job_state="completed"), Memory.of())
    assert (out.actions, out.phase) == ((), Phase.COMPLETED)
    assert out.reason == "the job completed; nothing left to run"


def test_agent_failure_after_completion_elsewhere_is_not_a_failure():
    out = d(snap(agent_pid=AGENT, agent_exit=1, job_state="completed"))
    assert (out.actions, out.phase) == ((), Phase.COMPLETED)


def test_agent_still_running_long_after_completion_is_stopped():
    first = d(live(job_state="completed"))
    assert first.actions == () and first.memory.life.completed_seen_at == T
    out = d(live(now=T + 30, job_state="completed"), first.memory)
    assert (out.kinds(), out.phase) == ([Kind.KILL_AGENT], Phase.COMPLETED)


def test_a_closed_rendezvous_of_an_unfinished_job_is_reopened_at_most_once_a_second():
    out = d(live(rdzv_closed=True))
    assert out.kinds() == [Kind.REOPEN_RENDEZVOUS] and "reopening it" in out.reason
    assert d(live(now=T + 0.5, rdzv_closed=True), out.memory).actions == ()
    assert d(live(now=T + 1.0, rdzv_closed=True), out.memory).kinds() == [Kind.REOPEN_RENDEZVOUS]


def test_a_rendezvous_closed_at_the_end_of_the_job_is_not_reopened():
    """The first agent to finish closes it (torch's shutdown) while the others' workers
    have completed too: no reopen, no warning, before the job's /state says completed."""
    assert Kind.REOPEN_RENDEZVOUS not in d(live(rdzv_closed=True, progress_event="completed")).kinds()
    assert Kind.REOPEN_RENDEZVOUS in d(live(rdzv_closed=True, progress_event="step")).kinds()


def test_a_closed_rendezvous_of_a_completed_job_stays_closed():
    assert Kind.REOPEN_RENDEZVOUS not in d(live(rdzv_closed=True, job_state="completed")).kinds()


@pytest.mark.parametrize("phase", [Phase.COMPLETED, Phase.FAILED, Phase.STOPPED])
def test_final_phases_do_nothing(phase):
    out = d(snap(agent_exit=1, departed=(B,), drain_request="x"), Memory.of(phase=phase))
    assert (out.actions, out.phase) == ((), phase)


# -- checkpoint hint ------------------------------------------------------------------------

def test_a_new_committed_checkpoint_is_published_once():
    out = d(live(checkpoint_step=40))
    assert [(a.kind, a["step"]) for a in out.actions] == [(Kind.PUBLISH_CHECKPOINT, 40)]
    assert d(live(checkpoint_step=40), out.memory).actions == ()


# -- training hang ----------------------------------------------------------------------------

def test_hang_bound_is_derived_from_the_step_time_with_a_floor():
    assert hang_bound(POLICY, ()) == 10.0
    assert hang_bound(POLICY, (0.1, 0.1, 0.2)) == 10.0           # 20 x 0.1 s < floor
    assert hang_bound(POLICY, (1.0, 2.0, 3.0)) == 40.0           # 20 x the median
    assert hang_bound(replace(POLICY, hang_timeout_s=7.0), (1.0,)) == 7.0


def test_a_stalled_step_with_live_workers_is_a_hang():
    stepping = d(live(step=5), RUNNING.but(step=4, step_at=T - 0.1)).memory
    assert d(live(now=T + 9.9, step=5), stepping).actions == ()
    out = d(live(now=T + 10, step=5), stepping)
    assert [(a.kind, a["pids"]) for a in out.actions[:1]] == [(Kind.KILL_WORKERS, W)]
    assert out.actions[1]["event"] == "training-hang"
    assert out.reason.startswith("training hung: no step for 10 s")
    assert d(live(now=T + 20, step=5), out.memory).actions == ()   # disarmed until the next step


def test_no_hang_before_the_first_step_of_a_worker_group():
    assert d(live(now=T + 1000, step=5), RUNNING.but(step=5, step_at=None)).actions == ()


def test_a_stall_explained_by_a_lost_peer_is_not_a_hang():
    mem = RUNNING.but(step=5, step_at=T - 100, suspects={"b": (B, T)})
    assert Kind.KILL_WORKERS not in d(live(step=5), mem).kinds()


def test_a_new_worker_group_disarms_the_hang_timer():
    mem = RUNNING.but(step=5, step_at=T - 100)
    out = d(live(step=5, workers=frozenset({41})), mem)
    assert out.memory.life.step_at is None and Kind.KILL_WORKERS not in out.kinds()


# -- recovery timing ----------------------------------------------------------------------------

def test_a_recovery_is_timed_from_the_eviction_to_the_next_completed_step():
    mem = RUNNING.but(dead={"b": Death(B, "crashed")}, step=7)
    evicting = d(live(step=7), mem).memory
    assert evicting.life.recovering == ("peer-crashed", T)
    restarted = d(live(now=T + 2, step=7, workers=frozenset({51})), evicting).memory
    assert restarted.life.failures == ()                        # a membership restart, not a crash
    resumed = d(live(now=T + 3, step=7, progress_event="resumed", workers=frozenset({51})), restarted)
    assert Kind.OBSERVE not in resumed.kinds()            # resumed is not a completed step
    out = d(live(now=T + 4.5, step=8, progress_event="step", workers=frozenset({51})), resumed.memory)
    observe = next(a for a in out.actions if a.kind is Kind.OBSERVE)
    assert (observe["label"], observe["value"]) == ("peer-crashed", 4.5)
    assert out.memory.life.recovering is None and "resumed 4.5 s after a peer-crashed" in out.reason


def test_the_action_table_covers_every_kind():
    from elasticd.daemon import ACTIONS, check_action_table

    check_action_table()
    partial = dict(ACTIONS)
    del partial[Kind.EVICT]
    with pytest.raises(RuntimeError, match="no executor for action.*evict"):
        check_action_table(partial)


def test_the_rank0_node_journals_progress_and_checkpoints():
    out = d(live(step=5, rank0_here=True, checkpoint_step=4))
    events = [a["event"] for a in out.actions if a.kind is Kind.JOURNAL]
    assert events == ["checkpoint-committed", "progress"]
    assert d(live(now=T + 10, step=6, rank0_here=True, checkpoint_step=4), out.memory).actions == ()
    later = d(live(now=T + 30, step=9, rank0_here=True, checkpoint_step=4), out.memory)
    assert [a["event"] for a in later.actions if a.kind is Kind.JOURNAL] == ["progress"]
    other = d(live(step=5, checkpoint_step=4))
    assert [a.kind for a in other.actions] == [Kind.PUBLISH_CHECKPOINT]


# -- in-place recovery ([recovery] mode = "in-place") ---------------------------------

INPLACE = replace(POLICY, recovery_mode=IN_PLACE, recovery_bound_s=5.0)
G = GenerationId(3, 0, "ep")
G1 = G.next()
REC = GenerationRecord(G1, renumber([("a", 2)]), "127.0.0.1:29600", ("b",), "peer-crashed")
REC_WITHOUT_US = GenerationRecord(G1, renumber([("b", 2)]), "127.0.0.1:29601", ("a",), "peer-crashed")


def lost_b(how: str = "crashed", **kw):
    """The decision that peer b died, with our workers stepping at generation G."""
    kw.setdefault("generation", G)
    return d(live(**kw), RUNNING.but(dead={"b": Death(B, how)}, step_at=T - 0.5), INPLACE)


def agreed(how: str = "crashed") -> Memory:
    """After the SHRINK came back ok and the eviction said b was in our round."""
    out = d(live(now=T + 0.1, generation=G, shrink=ShrinkOutcome(("b",), "ok", REC, wrote=True),
                 eviction=Eviction(("b",), ok=True, in_round=True)), lost_b(how).memory, INPLACE)
    return out.memory


def test_in_place_a_dead_peer_is_evicted_and_shrunk_not_killed():
    out = lost_b()
    assert out.kinds() == [Kind.EVICT, Kind.JOURNAL, Kind.COUNT, Kind.SHRINK]
    shrink = out.actions[3]
    assert (shrink["lost"], shrink["cause"], shrink["generation"]) == (("b",), "peer-crashed", G)
    assert shrink["peers"] == (B,) and "re-forming the world in place" in out.reason
    assert out.memory.reform.in_place == InPlace(("b",), T, G, "peer-crashed")


def test_in_place_workers_restarted_in_the_same_cycle_take_the_restart_path():
    """Seen by the chaos suite: a drain's coordinated stop restarted our workers in the cycle
    the leaver was found gone; their progress still named the old group's generation, the
    re-form's timer killed the new group mid-start and 6 steps were lost."""
    new_group = frozenset({4242})
    mem = RUNNING.but(dead={"b": Death(B, "left")}, step_at=T - 0.5, step=44)
    out = d(live(generation=G, workers=new_group, step=44), mem, INPLACE)
    assert "the agent restarted its workers" in out.reason
    assert Kind.SHRINK not in out.kinds() and out.memory.reform.in_place is None
    assert "restarting the local workers (they have not stepped" in out.reason
    later = d(live(now=T + 8, generation=G, workers=new_group, step=44), out.memory, INPLACE)
    assert Kind.KILL_WORKERS not in later.kinds()  # no re-form timer to run out


def test_restart_mode_never_shrinks():
    out = d(live(generation=G), RUNNING.but(dead={"b": Death(B, "crashed")}), POLICY)
    assert Kind.SHRINK not in out.kinds() and out.memory.reform.in_place is None


def test_in_place_workers_without_a_generation_take_the_restart_path():
    out = lost_b(generation=None)
    assert Kind.SHRINK not in out.kinds() and out.memory.reform.in_place is None
    fallback = [a for a in out.actions if a.kind is Kind.JOURNAL and a["event"] == "in-place-fallback"]
    assert fallback[0]["fields"]["reason"] == "the workers report no generation"
    planned = d(live(now=T + 0.1, eviction=Eviction(("b",), ok=True, in_round=True)), out.memory, INPLACE)
    assert planned.memory.peer.kill_at == T + 0.1 + 2.0


@pytest.mark.parametrize("how", ["crashed", "silent"])
def test_an_agreed_shrink_plans_no_kill(how):
    mem = agreed(how)
    assert mem.reform.in_place.agreed and mem.reform.generation_handed == G1
    assert mem.peer.kill_at is None
    out = d(live(now=T + 3, generation=G), mem, INPLACE)
    assert Kind.KILL_WORKERS not in out.kinds()


def test_a_failed_shrink_falls_back_to_the_restart_kill():
    out = d(live(now=T + 0.1, generation=G, eviction=Eviction(("b",), ok=True, in_round=True),
                 shrink=ShrinkOutcome(("b",), "failed", reason="no store")), lost_b("silent").memory,
            INPLACE)
    assert out.kinds() == [Kind.JOURNAL, Kind.COUNT, Kind.KILL_WORKERS]
    assert out.actions[0]["fields"]["reason"] == "no store" and out.memory.reform.in_place is None
    crashed = d(live(now=T + 0.1, generation=G, eviction=Eviction(("b",), ok=True, in_round=True),
                     shrink=ShrinkOutcome(("b",), "failed", reason="x")), lost_b().memory, INPLACE)
    assert crashed.memory.peer.kill_at == T + 0.1 + 2.0


def test_a_shrink_that_fences_us_out_kills_our_workers():
    out = d(live(now=T + 0.1, generation=G, shrink=ShrinkOutcome(("b",), "fenced", REC_WITHOUT_US)),
            lost_b().memory, INPLACE)
    assert out.kinds()[0] is Kind.KILL_WORKERS and "without this node" in out.reason
    assert out.memory.reform.in_place is None


def test_an_unneeded_shrink_ends_quietly():
    out = d(live(now=T + 0.1, generation=G, shrink=ShrinkOutcome(("b",), "unneeded")),
            lost_b().memory, INPLACE)
    assert out.actions == () and out.memory.reform.in_place is None


def test_the_reformed_report_is_one_recovered_in_place_event():
    mem = agreed().but(recovering=("peer-crashed", T), journaled_at=T)
    out = d(live(now=T + 1.5, generation=G1, step=41, progress_event="reformed", rank0_here=True,
                 world=WorldView("a", G1, 0, 2, 2),
                 reform=Reform("reformed", duration_s=0.8, from_world_size=4, cause="peer-crashed")),
            mem, INPLACE)
    journal = [a for a in out.actions if a.kind is Kind.JOURNAL]
    assert [a["event"] for a in journal] == ["recovered-in-place"]
    assert journal[0]["fields"] == {"duration_s": 0.8, "daemon_s": 1.5, "from_world_size": 4,
                                    "world_size": 2, "generation": "3.1", "fault": "peer-crashed",
                                    "lost": ["b"]}
    assert [(a.kind, a["label"]) for a in out.actions if a.kind in (Kind.OBSERVE, Kind.COUNT)] == \
        [(Kind.OBSERVE, "in-place"), (Kind.COUNT, "ok")]
    assert out.memory.reform.in_place is None and out.memory.life.recovering is None
    assert "re-formed in place as generation 3.1 1.5 s" in out.reason
    # The next step is not a second (generic) recovery.
    later = d(live(now=T + 1.6, generation=G1, step=42, progress_event="step"), out.memory, INPLACE)
    assert Kind.JOURNAL not in later.kinds()


def test_an_eviction_outcome_after_the_re_form_plans_no_kill():
    """Measured: the workers re-formed 0.1 s after the crash, before the EVICT came back."""
    lost = lost_b()
    shrunk = d(live(now=T + 0.05, generation=G, shrink=ShrinkOutcome(("b",), "ok", REC, wrote=True)),
               lost.memory, INPLACE)
    done = d(live(now=T + 0.1, generation=G1, step=41, progress_event="reformed",
                  world=WorldView("a", G1, 0, 2, 2), reform=Reform("reformed", duration_s=0.02)),
             shrunk.memory, INPLACE)
    assert done.memory.reform.in_place is None and done.memory.reform.reformed_without == {"b"}
    late = d(live(now=T + 0.2, generation=G1, eviction=Eviction(("b",), ok=True, in_round=True)),
             done.memory, INPLACE)
    assert late.memory.peer.kill_at is None and Kind.KILL_WORKERS not in late.kinds()


def test_a_peer_lost_again_after_a_restart_is_not_taken_as_already_re_formed():
    """Issue 29 finding 6: ``reformed_without`` only grew. b was re-formed out, came back
    (a new round: a new worker group), then went silent before the group's first step:
    our workers, hung on it, must be killed, not left to the collective timeout."""
    done = RUNNING.but(reformed_without=frozenset({"b"}))
    regrouped = d(live(now=T + 30, workers=frozenset({31, 32}), generation=G), done, INPLACE)
    assert regrouped.memory.reform.reformed_without == frozenset()
    mem = regrouped.memory.but(evicting={"b": Death(B, "silent", 1)})
    out = d(live(now=T + 31, workers=frozenset({31, 32}), generation=G,
                 eviction=Eviction(("b",), ok=True, in_round=True)), mem, INPLACE)
    assert [(a.kind, a["pids"]) for a in out.actions] == [(Kind.KILL_WORKERS, frozenset({31, 32}))]


def test_a_missed_reformed_record_still_counts_once_by_the_generation():
    out = d(live(now=T + 2, generation=G1, step=42, progress_event="step", rank0_here=True),
            agreed().but(journaled_at=T), INPLACE)
    assert [a["event"] for a in out.actions if a.kind is Kind.JOURNAL] == ["recovered-in-place"]


def test_reform_failed_is_one_fallback_and_the_restart_is_a_membership_one():
    failed = d(live(now=T + 2, generation=G, progress_event="reform-failed",
                    reform=Reform("reform-failed", duration_s=1.2, reason="timeout")), agreed(), INPLACE)
    assert failed.kinds() == [Kind.JOURNAL, Kind.COUNT]
    assert failed.actions[0]["event"] == "in-place-fallback"
    assert failed.actions[0]["fields"]["reason"] == "timeout"
    assert failed.actions[0]["fields"]["duration_s"] == 1.2
    assert (failed.actions[1]["metric"], failed.actions[1]["label"]) == ("in_place_recoveries", "fallback")
    restarted = d(live(now=T + 5, workers=frozenset({31, 32}), rank0_here=True),
                  failed.memory.but(journaled_at=T), INPLACE)
    assert restarted.actions[0]["fields"] == {"cause": "membership"}


def test_a_re_form_that_fails_in_the_cycle_its_shrink_returns_is_not_handed_again():
    """Seen with a fault-injected re-form: the fallback and the SHRINK's outcome came in one
    cycle; the restarted workers (still showing the old progress file) got the record again
    and a second fallback was journaled."""
    both = d(live(now=T + 0.1, generation=G, progress_event="reform-failed",
                  reform=Reform("reform-failed", duration_s=0.01, reason="fault injected"),
                  shrink=ShrinkOutcome(("b",), "ok", REC, wrote=True),
                  eviction=Eviction(("b",), ok=True, in_round=True)), lost_b().memory, INPLACE)
    assert [a["event"] for a in both.actions if a.kind is Kind.JOURNAL] == ["in-place-fallback"]
    assert both.memory.reform.generation_handed == G1
    restarted = d(live(now=T + 2.6, workers=frozenset({31}), generation=G, generation_record=REC,
                       progress_event="reform-failed", rank0_here=True,
                       reform=Reform("reform-failed", duration_s=0.01, reason="fault injected")),
                  both.memory, INPLACE)
    assert Kind.WRITE_GENERATION not in restarted.kinds()
    assert [a["event"] for a in restarted.actions if a.kind is Kind.JOURNAL] == ["workers-restarted"]


def test_workers_that_exit_during_a_re_form_fall_back():
    out = d(live(now=T + 1, workers=frozenset({31, 32}), generation=G, rank0_here=True),
            agreed(), INPLACE)
    journal = [a for a in out.actions if a.kind is Kind.JOURNAL]
    assert [a["event"] for a in journal] == ["in-place-fallback", "workers-restarted"]
    assert journal[0]["fields"]["reason"] == "workers-exited"
    assert journal[1]["fields"] == {"cause": "membership"}


def test_no_re_form_within_the_bound_kills_the_workers():
    mem = agreed()
    assert Kind.KILL_WORKERS not in d(live(now=T + 6.9, generation=G), mem, INPLACE).kinds()
    out = d(live(now=T + 7.0, generation=G), mem, INPLACE)
    assert out.kinds() == [Kind.KILL_WORKERS, Kind.JOURNAL, Kind.COUNT]
    assert out.actions[1]["fields"] == {"reason": "timeout", "duration_s": 7.0, "lost": ["b"]}
    assert out.memory.reform.in_place is None


def test_a_re_form_is_not_a_training_hang():
    mem = agreed().but(step_at=T - 500, intervals=(0.1,))
    out = d(live(now=T + 1, generation=G), mem, INPLACE)
    assert not any(a.kind is Kind.JOURNAL and a["event"] == "training-hang" for a in out.actions)


def test_a_second_loss_during_a_re_form_widens_it():
    c = PeerView("c", "running", ("127.0.0.1", 78), 6, "127.0.0.1:8")
    mem = agreed().but(dead={"c": Death(c, "silent")})
    out = d(live(now=T + 1, generation=G), mem, INPLACE)
    shrink = next(a for a in out.actions if a.kind is Kind.SHRINK)
    assert shrink["lost"] == ("b", "c") and shrink["generation"] == G
    assert out.memory.reform.in_place.since == T


def test_the_backstop_hands_a_newer_record_of_our_round_to_our_workers():
    out = d(live(generation=G, generation_record=REC, node_id="a"), RUNNING, INPLACE)
    assert out.kinds() == [Kind.WRITE_GENERATION] and out.actions[0]["record"] == REC
    assert out.memory.reform.in_place.agreed and out.memory.reform.generation_handed == G1
    again = d(live(now=T + 0.1, generation=G, generation_record=REC, node_id="a"), out.memory, INPLACE)
    assert Kind.WRITE_GENERATION not in again.kinds()


def test_the_backstop_ignores_other_rounds_and_old_records_and_restart_mode():
    other = replace(REC, id=GenerationId(2, 5, "ep"))
    for s, policy in ((live(generation=G, generation_record=other, node_id="a"), INPLACE),
                      (live(generation=G1, generation_record=REC, node_id="a"), INPLACE),
                      (live(generation=G, generation_record=REC, node_id="a"), POLICY)):
        assert d(s, RUNNING, policy).actions == ()


def test_the_backstop_kills_workers_a_record_leaves_out():
    out = d(live(generation=G, generation_record=REC_WITHOUT_US, node_id="a"), RUNNING, INPLACE)
    assert out.kinds()[0] is Kind.KILL_WORKERS
    assert out.memory.reform.in_place is None and out.memory.reform.generation_handed == G1


def test_our_world_is_published_when_it_changes():
    view = WorldView("a", G, 0, 2, 4)
    out = d(live(world=view), RUNNING)
    assert out.kinds() == [Kind.PUBLISH]
    assert out.actions[0]["fields"] == {"world": {"generation": {"round": 3, "seq": 0, "epoch": "ep"},
                                                  "first_rank": 0, "nproc": 2, "world_size": 4}}
    assert d(live(world=view), out.memory).actions == ()


# -- divergence ---------------------------------------------------------------------------

def test_a_diverged_loss_marks_the_node_failed_at_once():
    out = d(live(step=1240, progress_event="diverged"))
    assert out.phase is Phase.FAILED
    assert "training diverged at step 1240" in out.reason and "lower the learning rate" in out.reason
    events = [a["event"] for a in out.actions if a.kind is Kind.JOURNAL]
    assert events == ["training-diverged", "node-failed"]


def test_a_diverged_event_while_draining_is_left_to_the_drain():
    draining = replace(RUNNING, phase=Phase.DRAINING).but(drain_reason="a drain request")
    assert d(live(step=10, progress_event="diverged"), draining).phase is Phase.DRAINING


# -- a node that cannot resume leaves; its peers count no crash (trainer.fitness) ----------

def test_a_node_whose_workers_cannot_resume_leaves_the_job_at_once_saying_why():
    why = "its checkpoint directory /mnt/ckpt shows no checkpoint but the job's newest is step 217"
    out = d(live(step=0, progress_event="unfit", progress_reason=why))
    assert out.phase is Phase.FAILED
    assert why in out.reason and "leaves the job" in out.reason
    journal = [a for a in out.actions if a.kind is Kind.JOURNAL]
    assert [a["event"] for a in journal] == ["node-unfit", "node-failed"]
    assert journal[0]["fields"]["reason"] == why


def test_workers_restarted_because_a_peer_cannot_resume_spend_no_crash_budget():
    mem = RUNNING
    for i in range(POLICY.crash_loop_failures + 2):  # more restarts than the budget
        out = d(live(now=T + 60 * i, workers=frozenset({100 + i}), progress_event="peer-unfit"), mem)
        mem = out.memory
        assert out.phase is Phase.RUNNING and mem.life.failures == (), out.reason
        assert "after a membership" in out.reason


def test_an_unfit_event_while_draining_is_left_to_the_drain():
    draining = replace(RUNNING, phase=Phase.DRAINING).but(drain_reason="a drain request")
    assert d(live(step=10, progress_event="unfit"), draining).phase is Phase.DRAINING


# -- one journal writer per fault (issue 14): every survivor decides, one writes ------------

def _peer(node: str, first_rank: int | None, state: str = "running") -> PeerView:
    world = None if first_rank is None else WorldView(node, G, first_rank, 1, 4)
    return PeerView(node, state, ("127.0.0.1", 70 + len(node)), 5, world=world)


def _journaled(out) -> list[str]:
    return [a["event"] for a in out.actions if a.kind is Kind.JOURNAL and a["event"] != "progress"]


@pytest.mark.parametrize("lost", ["a", "b", "d"])
def test_a_lost_peer_is_journaled_by_exactly_one_survivor_the_lowest_rank(lost):
    """Four nodes a..d at ranks 0..3 (a: rank 0); each survivor decides the same loss
    from the same records, and only the survivor with the lowest rank writes ``peer-lost``."""
    ranks = {"a": 0, "b": 1, "c": 2, "d": 3}
    writers, evicted = [], []
    for me in (n for n in ranks if n != lost):
        peers = {n: _peer(n, r) for n, r in ranks.items() if n != me}
        mem = RUNNING.but(dead={lost: Death(peers[lost], "crashed")}, journaled_at=T)
        out = d(live(node_id=me, peers=peers, world=WorldView(me, G, ranks[me], 1, 4)), mem)
        evicted.append(Kind.EVICT in out.kinds())
        if _journaled(out) == ["peer-lost"]:
            writers.append(me)
        assert [a["label"] for a in out.actions if a.kind is Kind.COUNT] == ["crashed"]
    assert all(evicted)
    assert writers == [min((n for n in ranks if n != lost), key=ranks.get)]


def test_the_loss_writer_skips_peers_that_are_lost_leaving_or_refusing_and_falls_back_to_ids():
    peers = {"a": _peer("a", None), "b": _peer("b", None, "leaving"), "c": _peer("c", None)}
    mine = Snapshot(now=T, node_id="c", peers=peers)
    assert not records_loss(mine, RUNNING, {"x"})            # a: alive, lower id, no world
    assert records_loss(mine, RUNNING, {"a"})                # a lost; b leaving
    assert records_loss(mine, RUNNING.but(refused_at={"a": T}), ())
    assert records_loss(replace(mine, world=WorldView("c", G, 0, 1, 3)), RUNNING, ())  # a rank beats no world


@pytest.mark.parametrize(("kind", "rank0", "writes"), [
    ("peer-crashed", True, True), ("peer-crashed", False, False), ("peer-silent", False, False),
    ("worker-crash", False, True), ("agent-crash", False, True), ("hang", False, True)])
def test_a_recovery_is_journaled_by_the_new_rank_0_or_by_the_node_of_a_local_fault(kind, rank0, writes):
    assert records_recovery(Snapshot(now=T, rank0_here=rank0), kind) is writes
    mem = RUNNING.but(recovering=(kind, T - 2), step=40, journaled_at=T)
    out = d(live(step=41, progress_event="step", rank0_here=rank0), mem)
    assert _journaled(out) == (["recovered"] if writes else [])
    assert [a["label"] for a in out.actions if a.kind is Kind.OBSERVE] == [kind]   # every node's metric


def test_only_the_new_rank_0_journals_the_in_place_recovery():
    for rank0 in (True, False):
        out = d(live(now=T + 1.5, generation=G1, step=41, progress_event="reformed", rank0_here=rank0,
                     world=WorldView("a", G1, 0 if rank0 else 1, 1, 2),
                     reform=Reform("reformed", duration_s=0.8, from_world_size=3)),
                agreed().but(journaled_at=T), INPLACE)
        assert _journaled(out) == (["recovered-in-place"] if rank0 else [])
        assert [(a.kind, a["label"]) for a in out.actions if a.kind in (Kind.OBSERVE, Kind.COUNT)] == \
            [(Kind.OBSERVE, "in-place"), (Kind.COUNT, "ok")]


def test_a_membership_restart_is_journaled_by_the_rank_0_node_and_a_crash_by_its_own():
    member = RUNNING.but(membership_changed_at=T - 1, journaled_at=T)
    for rank0 in (True, False):
        out = d(live(workers=frozenset({21}), rank0_here=rank0), member)
        assert _journaled(out) == (["workers-restarted"] if rank0 else [])
    crash = d(live(workers=frozenset({21}), rank0_here=False), RUNNING.but(journaled_at=T))
    assert _journaled(crash) == ["workers-restarted"]


# -- a round that names a gone agent releases ours (issue 29 finding 1) -------------------

MINE, B_AGENT, D_AGENT = ("127.0.0.1", AGENT), ("127.0.0.1", 77), ("127.0.0.1", 99)
FORMING = RUNNING.but(workers=frozenset(), step_at=None)


def _forming(now: float = T, members=(MINE, B_AGENT, D_AGENT), peers=None, **kw) -> Snapshot:
    """Our agent in round 5 (our workers last trained in round 4), ``d`` gone."""
    kw = {"round": 5, "generation": GenerationId(4, 0, "ep"), **kw}
    return live(now=now, workers=frozenset(), round_members=frozenset(members),
                agent_addr="127.0.0.1", node_id="a", peers={"b": B} if peers is None else peers,
                **kw)


def test_a_round_naming_a_gone_agent_releases_ours_after_the_grace_and_no_failure_is_counted():
    first = d(_forming())
    assert first.actions == () and first.memory.life.round_broken_since == T
    assert d(_forming(now=T + 1.0), first.memory).actions == ()
    out = d(_forming(now=T + POLICY.broken_round_grace_s), first.memory)
    assert out.kinds() == [Kind.KILL_AGENT, Kind.LEAVE_RENDEZVOUS, Kind.COUNT]
    assert "round 5 names agent(s) 127.0.0.1:99 that are gone" in out.reason
    exited = d(_forming(now=T + 3, agent_exit=-9), out.memory)
    assert exited.phase is Phase.BACKOFF and exited.memory.life.failures == ()
    assert exited.memory.life.restart_at == T + 3 and "neither a completion nor a failure" in exited.reason
    again = d(snap(now=T + 3.1), exited.memory)
    assert Kind.START_AGENT in again.kinds() and not again.memory.life.agent_released


def test_a_round_whose_members_all_live_or_come_back_is_left_alone():
    d_peer = PeerView("d", "running", D_AGENT, 9, "127.0.0.1:9")
    assert d(_forming(peers={"b": B, "d": d_peer})).actions == ()
    first = d(_forming())
    back = d(_forming(now=T + 1, peers={"b": B, "d": d_peer}), first.memory)
    assert back.memory.life.round_broken_since is None
    assert d(_forming(now=T + 3, peers={"b": B, "d": d_peer}), back.memory).actions == ()


@pytest.mark.parametrize("state", ["failed", "leaving", "completed"])
def test_a_member_whose_node_left_or_failed_is_gone_and_released_after_the_grace(state):
    """Not at once (tried: 704bf82): the scale harness's survivors then had their agents
    killed while those were already forming the next round (etcd: lease not found)."""
    d_peer = PeerView("d", state, D_AGENT, 9, "127.0.0.1:9")
    first = d(_forming(peers={"b": B, "d": d_peer}))
    assert first.actions == () and first.memory.life.round_broken_since == T
    out = d(_forming(now=T + POLICY.broken_round_grace_s, peers={"b": B, "d": d_peer}),
            first.memory)
    assert out.kinds() == [Kind.KILL_AGENT, Kind.LEAVE_RENDEZVOUS, Kind.COUNT]


def test_release_broken_rounds_off_leaves_our_agent_in_the_round_as_torch_would():
    """The weakened run's switch: even a member known gone (its node left) is waited on."""
    off = replace(POLICY, release_broken_rounds=False)
    d_peer = PeerView("d", "leaving", D_AGENT, 9, "127.0.0.1:9")
    assert d(_forming(peers={"b": B, "d": d_peer}), policy=off).actions == ()
    assert d(_forming(now=T + 3600), policy=off).actions == ()


def test_a_member_the_majority_condemned_is_gone_though_its_record_lives():
    d_peer = PeerView("d", "running", D_AGENT, 9, "127.0.0.1:9")
    mem = FORMING.but(condemned={"d": D_AGENT})
    first = d(_forming(peers={"b": B, "d": d_peer}), mem)
    assert first.memory.life.round_broken_since == T
    late = d(_forming(now=T + POLICY.broken_round_grace_s, peers={"b": B, "d": d_peer}),
             first.memory)
    assert Kind.KILL_AGENT in late.kinds()


def test_a_member_whose_record_vanished_is_released_after_the_grace():
    d_peer = PeerView("d", "running", D_AGENT, 9, "127.0.0.1:9")
    before = d(_forming(peers={"b": B, "d": d_peer}))
    assert before.actions == ()
    vanished = d(_forming(now=T + 0.5, departed=(d_peer,)), before.memory)
    assert Kind.KILL_AGENT not in vanished.kinds()
    assert vanished.memory.life.round_broken_since == T + 0.5   # the grace starts: it is gone now


def test_workers_that_trained_in_the_round_leave_a_loss_to_the_in_place_path():
    trained = _forming(generation=GenerationId(5, 1, "ep"))
    first = d(trained)
    assert first.memory.life.round_broken_since is None
    assert d(replace(trained, now=T + 3), first.memory).actions == ()


def test_workers_that_report_no_generation_or_no_round_are_not_judged():
    for s in (_forming(generation=None, step=40), _forming(round=None)):
        first = d(s)
        assert d(replace(s, now=T + 3), first.memory).actions == ()


def test_a_joiner_whose_workers_never_reported_is_released_from_a_round_naming_a_gone_agent():
    """Goodput seed 11: a joiner's agent sat in round 9 with a member killed 3 s after the
    close; its daemon took "no progress yet" for "a script without generations" and never
    released it, and round 10 waited on the joiner's live agent for good (40 s, to the
    trace's end). Nothing reported: these workers trained in no round."""
    s = _forming(generation=None, step=None)
    first = d(s)
    assert first.memory.life.round_broken_since == T
    out = d(replace(s, now=T + POLICY.broken_round_grace_s), first.memory)
    assert out.kinds() == [Kind.KILL_AGENT, Kind.LEAVE_RENDEZVOUS, Kind.COUNT]


def test_a_round_our_agent_is_not_in_is_not_one_it_waits_in():
    """Released, our new agent joins the next round; the pointer still names the broken
    one until that round closes: no second release (measured: a release every 2.5 s)."""
    s = _forming(members=(("127.0.0.1", 1), B_AGENT, D_AGENT))
    first = d(s)
    assert d(replace(s, now=T + 3), first.memory).actions == ()


# -- a start that never reaches its first step (issue 29 finding 9) ----------------------

def test_workers_without_a_first_step_past_the_start_bound_are_killed_as_a_crash():
    started = d(live(workers=frozenset({21})), RUNNING.but(membership_changed_at=T - 3))
    assert started.memory.life.workers_at == T and started.memory.life.step_at is None
    bound = POLICY.start_timeout_s
    assert d(live(now=T + bound - 1, workers=frozenset({21})), started.memory).actions == ()
    out = d(live(now=T + bound, workers=frozenset({21})), started.memory)
    assert out.kinds() == [Kind.KILL_WORKERS, Kind.JOURNAL]
    assert out.actions[1]["event"] == "start-hang" and "no first step" in out.reason
    restarted = d(live(now=T + bound + 1, workers=frozenset({22})), out.memory)
    assert restarted.memory.life.failures == (T + bound + 1,)       # this node's own crash


def test_a_group_that_never_stepped_while_a_peer_was_unreachable_is_no_crash():
    started = d(live(workers=frozenset({21})), RUNNING.but(membership_changed_at=T - 3))
    suspecting = started.memory.but(suspicions={"b": ("silent", T + 1)})
    out = d(live(now=T + 200, workers=frozenset({22})), suspecting)
    assert out.memory.life.failures == () and "after a membership" in out.reason


def test_a_group_that_stepped_is_judged_by_the_hang_bound_not_the_start_bound():
    started = d(live(workers=frozenset({21})), RUNNING.but(membership_changed_at=T - 3))
    stepped = d(live(now=T + 1, workers=frozenset({21}), step=5), started.memory)
    later = d(live(now=T + POLICY.start_timeout_s + 1, workers=frozenset({21}), step=6), stepped.memory)
    assert Kind.KILL_WORKERS not in later.kinds()


# -- a loss while a peer drains (goodput seed 7: a freeze, a drain 2.3 s later) ----------

def test_a_loss_while_a_peer_drains_shrinks_without_the_drainer_too():
    """The drainer's coordinated stop needs the old world, which lost a member: it would
    hold the re-form until its drain grace ran out (30 s) and it re-forms with no one."""
    leaving = PeerView("c", "leaving", ("127.0.0.1", 88), 6, "127.0.0.1:10")
    out = lost_b(peers={"b": B, "c": leaving})
    shrink = next(a for a in out.actions if a.kind is Kind.SHRINK)
    assert shrink["lost"] == ("b", "c") and shrink["peers"] == (B,)   # only b is evicted
    assert out.memory.reform.in_place.lost == ("b", "c")
    back = lost_b(peers={"b": B, "c": replace(leaving, state="running")})
    assert back.memory.reform.in_place.lost == ("b",)


def test_a_draining_node_left_out_of_the_next_generation_kills_its_workers_once():
    draining = replace(RUNNING, phase=Phase.DRAINING).but(drain_deadline=T + 30)
    s = live(generation=G, generation_record=REC_WITHOUT_US, node_id="a")
    out = d(s, draining, INPLACE)
    assert out.kinds() == [Kind.KILL_WORKERS] and out.phase is Phase.DRAINING
    assert "agreed without this draining node" in out.reason
    assert d(replace(s, now=T + 0.5), out.memory, INPLACE).actions == ()   # once
    # A generation that keeps us, or none newer than our workers', changes nothing.
    assert d(live(generation=G, generation_record=REC, node_id="a"), draining, INPLACE).actions == ()
    assert d(live(generation=G1, generation_record=REC_WITHOUT_US, node_id="a"), draining,
             INPLACE).actions == ()


# -- a drain in place (issue 26): the leaver's side -----------------------------------------

def _stepping(**kw) -> Snapshot:
    """Workers of generation G in a live world, as a drain in place needs them."""
    kw.setdefault("generation", G)
    kw.setdefault("node_id", "a")
    kw.setdefault("step", 10)
    kw.setdefault("world", WorldView("a", G, 0, 2, 4))
    kw.setdefault("peers", {"b": B_STEPPING})
    return live(**kw)


B_STEPPING = replace(B, world=WorldView("b", G, 2, 2, 4), store="127.0.0.1:29601")
STEPPED = RUNNING.but(step=10, step_at=T - 0.1, intervals=(0.1, 0.1, 0.1),
                      published_world=WorldView("a", G, 0, 2, 4), peers_seen=frozenset({"b"}))
DRAINED = GenerationRecord(G1, renumber([("b", 2)]), "127.0.0.1:29601", ("a",), "drain",
                           planned=True)


def _drain_ok(**kw):
    return ShrinkOutcome(("a",), "ok", DRAINED, **kw)


def test_a_drain_in_place_agrees_a_generation_instead_of_stopping_every_rank():
    out = d(_stepping(drain_request="SIGTERM was received"), STEPPED, INPLACE)
    assert out.phase is Phase.DRAINING and out.memory.life.drain_in_place
    assert out.kinds() == [Kind.PUBLISH, Kind.JOURNAL, Kind.NOTIFY, Kind.DRAIN_IN_PLACE]
    assert out.actions[3]["generation"] == G
    assert out.actions[1]["fields"]["in_place"] is True
    assert out.reason == "draining because SIGTERM was received (grace 60 s, in place)"


@pytest.mark.parametrize("why, s, m, policy", [
    ("restart mode", _stepping(), STEPPED, POLICY),
    ("no generation reported", _stepping(generation=None), STEPPED, INPLACE),
    ("not stepped since the workers started", _stepping(step=None), RUNNING, INPLACE),
    ("a re-form under way", _stepping(), STEPPED.but(in_place=InPlace(("b",), T, G, "peer-crashed")),
     INPLACE),
    ("no workers", _stepping(workers=frozenset()), STEPPED, INPLACE),
    ("a world of this node alone", _stepping(world=WorldView("a", G, 0, 2, 2)), STEPPED, INPLACE),
    ("the peers' part of the world not published yet", _stepping(peers={"b": B}), STEPPED,
     INPLACE),
])
def test_a_drain_stops_every_rank_where_it_cannot_run_in_place(why, s, m, policy):
    out = d(replace(s, drain_request="x"), m, policy)
    assert Kind.DRAIN_IN_PLACE not in out.kinds() and Kind.TOUCH_STOP_FILE in out.kinds(), why
    assert not out.memory.life.drain_in_place


def _draining_in_place():
    return d(_stepping(drain_request="x"), STEPPED, INPLACE).memory


def test_the_drain_outcome_marks_the_record_handed_so_it_is_not_taken_for_a_fencing():
    m = d(_stepping(now=T + 0.1, drain_request="x", drained=_drain_ok(wrote=True)),
          _draining_in_place(), INPLACE).memory
    assert m.reform.generation_handed == G1
    # The record, once etcd's view shows it, does not kill our workers (they stop by themselves).
    out = d(_stepping(now=T + 1, drain_request="x", generation_record=DRAINED), m, INPLACE)
    assert out.actions == () and out.phase is Phase.DRAINING


def test_our_workers_gone_after_the_agreed_step_ends_the_agent():
    m = d(_stepping(now=T + 0.1, drain_request="x", drained=_drain_ok()), _draining_in_place(),
          INPLACE).memory
    out = d(_stepping(now=T + 0.4, drain_request="x", workers=frozenset()), m, INPLACE)
    assert out.kinds() == [Kind.LEAVE_RENDEZVOUS, Kind.KILL_AGENT]
    assert "stopped after the agreed step" in out.reason
    done = d(snap(now=T + 0.5, agent_pid=AGENT, agent_exit=-9, drain_request="x", step=12),
             out.memory, INPLACE)
    assert done.phase is Phase.STOPPED
    assert done.kinds() == [Kind.JOURNAL, Kind.DELETE_DRAIN_KEY, Kind.OBSERVE]
    assert done.actions[0]["fields"] == {"step": 12, "drain_s": 0.5, "in_place": True}
    assert done.actions[2]["label"] == "in-place"


def test_a_failed_drain_agreement_falls_back_to_every_ranks_stop():
    failed = ShrinkOutcome(("a",), "failed", reason="no survivors")
    out = d(_stepping(now=T + 0.1, drain_request="x", drained=failed), _draining_in_place(), INPLACE)
    assert out.kinds() == [Kind.COUNT, Kind.TOUCH_STOP_FILE, Kind.TERMINATE_AGENT]
    assert "fell back to a coordinated stop" in out.reason and "no survivors" in out.reason
    assert not out.memory.life.drain_in_place
    # From then on it is the coordinated stop's drain.
    later = d(_stepping(now=T + 60, drain_request="x"), out.memory, INPLACE)
    assert later.kinds() == [Kind.KILL_AGENT]


def test_workers_that_outlast_the_bound_fall_back_to_every_ranks_stop():
    m = d(_stepping(now=T + 0.1, drain_request="x", drained=_drain_ok()), _draining_in_place(),
          INPLACE).memory
    bound = INPLACE.recovery_bound_s + IN_PLACE_SLACK_S + 2 * 0.1
    assert d(_stepping(now=T + bound - 0.01, drain_request="x"), m, INPLACE).actions == ()
    out = d(_stepping(now=T + bound, drain_request="x"), m, INPLACE)
    assert Kind.TOUCH_STOP_FILE in out.kinds() and "had not stopped" in out.reason


# -- a drain in place: the others' side ---------------------------------------------------

def test_a_peers_planned_record_is_handed_over_and_timed_with_its_step_boundary():
    peer_drained = GenerationRecord(G1, renumber([("a", 2)]), "127.0.0.1:29600", ("b",), "drain",
                                    planned=True)
    out = d(_stepping(generation_record=peer_drained), STEPPED, INPLACE)
    assert out.kinds() == [Kind.WRITE_GENERATION]
    assert "after the step the world agrees" in out.reason
    ip = out.memory.reform.in_place
    assert ip.planned and ip.fault == "drain" and ip.lost == ("b",)
    bound = INPLACE.recovery_bound_s + IN_PLACE_SLACK_S + 2 * 0.1
    assert d(_stepping(now=T + bound - 0.01), out.memory, INPLACE).actions == ()
    done = d(_stepping(now=T + 0.3, generation=G1, rank0_here=True), out.memory, INPLACE)
    assert "re-formed in place as generation 3.1" in done.reason and "after a drain" in done.reason
    observed = next(a for a in done.actions if a.kind is Kind.OBSERVE)
    assert observed["label"] == "drain-in-place"


def test_a_drained_peers_departure_is_no_fault_for_workers_that_re_formed_without_it():
    reformed = STEPPED.but(reformed_without=frozenset({"b"}))
    leaving = replace(B, state="leaving")
    out = d(_stepping(departed=(leaving,), peers={}), reformed, INPLACE)
    assert out.kinds() == [Kind.EVICT, Kind.COUNT]                  # no SHRINK, no peer-lost
    assert out.memory.life.recovering is None                       # nothing to time
    assert "already re-formed without" in out.reason
    # A peer they did not re-form without is still a loss.
    lost = d(_stepping(departed=(leaving,), peers={}), STEPPED, INPLACE)
    assert Kind.SHRINK in lost.kinds() and lost.memory.life.recovering is not None


# -- the phase table ---------------------------------------------------------------------

def test_every_phase_change_is_in_the_table_and_others_are_refused():
    """The docstring's diagram as data: FAILED only from RUNNING, nothing out of a final
    phase, DRAINING only to STOPPED or COMPLETED."""
    assert {p for p, to in PHASE_EDGES.items() if Phase.FAILED in to} == {Phase.RUNNING}
    assert all(not PHASE_EDGES[p] for p in Phase if p.final)
    assert PHASE_EDGES[Phase.DRAINING] == {Phase.STOPPED, Phase.COMPLETED}
    backoff = replace(RUNNING, phase=Phase.BACKOFF)
    assert change_phase(backoff, Phase.RUNNING, restart_at=None).phase is Phase.RUNNING
    with pytest.raises(IllegalPhaseChange, match="backoff -> failed is not a phase change"):
        change_phase(backoff, Phase.FAILED)
    with pytest.raises(IllegalPhaseChange, match="draining -> running"):
        change_phase(replace(RUNNING, phase=Phase.DRAINING), Phase.RUNNING)


def _diagram_edges(doc: str) -> set[tuple[Phase, Phase]]:
    """The phase changes the module docstring's diagram draws. A line's first segment
    names its sources (a phase list, "any non-final", or nothing: a branch of the
    RUNNING trunk); each arrow's target is the first phase named after it."""
    names = {p.name: p for p in Phase}
    diagram = doc.split("Phases and their edges::", 1)[1].split("\n\n", 2)[1]

    def phases(segment: str) -> list[Phase]:
        segment = re.sub(r"\([^)]*\)", "", segment)
        if "any non-final" in segment:
            return [p for p in Phase if not p.final]
        return [names[w] for w in re.findall(r"\b[A-Z]+\b", segment) if w in names]

    edges = set()
    for line in diagram.splitlines():
        segments = re.split(r"──[^▶]*?──▶", line)
        if len(segments) < 2:
            continue  # a continuation of the comment above it
        sources = phases(segments[0]) or [Phase.RUNNING]
        for target_text in segments[1:]:
            target = phases(target_text)[0]
            edges |= {(s, target) for s in sources if s is not target}
            sources = [target]
    return edges


def test_the_docstring_diagram_draws_exactly_the_table():
    table = {(p, to) for p, tos in PHASE_EDGES.items() for to in tos}
    assert _diagram_edges(supervisor.__doc__) == table


# -- the memory's records ---------------------------------------------------------------------

def test_memory_but_routes_each_field_to_the_record_that_owns_it():
    mem = RUNNING.but(failures=(1.0,), dead={"b": Death(B, "crashed")}, generation_handed=G1,
                      journaled_at=5.0)
    assert mem.life.failures == (1.0,) and mem.peer.dead == {"b": Death(B, "crashed")}
    assert mem.reform.generation_handed == G1 and mem.journal.journaled_at == 5.0
    assert mem.life.workers == W and mem.phase is Phase.RUNNING   # the rest kept
    assert RUNNING.life.failures == ()                           # frozen: a new memory


def test_memory_but_refuses_the_phase_and_names_an_unknown_field():
    with pytest.raises(TypeError, match="change_phase"):
        RUNNING.but(phase=Phase.FAILED)
    with pytest.raises(TypeError, match="'restart_after'"):
        RUNNING.but(restart_after=1.0)
