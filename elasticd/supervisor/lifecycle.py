"""This node's own run: the agent's start, exit and backoff, the crash count and its
reset, worker restarts and their cause, hangs, a diverged or unfit node, the drain and the
job's completion."""

from __future__ import annotations

import statistics

from elasticd.actions import Action, Kind, act
from elasticd.contract.generation import base_of
from elasticd.contract.progress import WORKING
from elasticd.contract.settings import IN_PLACE
from elasticd.supervisor.joining import entering, joins_in_place
from elasticd.supervisor.journal import records_recovery
from elasticd.supervisor.reform import left_out_while_draining, reform_bound_s
from elasticd.supervisor.state import (
    Memory,
    Phase,
    Policy,
    Snapshot,
    agent_running,
    begin_recovery,
    change_phase,
)


def progress(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Track the step; a step past the highest one reached before the last failure
    ends a crash loop, and the first completed step after a fault ends its recovery
    (timed).

    New ground, not any step: a restart resumes a checkpoint behind the failure, so
    "stepped since the start" let a loop that fails at the same step every time (a
    bad sample, a diverging model) clear its count forever (found by the goodput run)."""
    if snap.step is None or snap.step == mem.life.step or snap.progress_event == "warm":
        return mem, [], ""   # (a warm newcomer's step is not its world's: it has none yet)
    intervals = mem.life.intervals
    if mem.life.step_at is not None:
        intervals = (*intervals, snap.now - mem.life.step_at)[-20:]
    cleared = bool(mem.life.failures) and snap.step > mem.life.failed_at_mark
    mem = mem.but(step=snap.step, step_at=snap.now, intervals=intervals,
                  high_water=max(mem.life.high_water, snap.step),
                  failures=() if cleared else mem.life.failures)
    notes = ["training progressed past the last failure; the crash count is reset"] if cleared else []
    actions: list[Action] = []
    if (mem.life.recovering is not None and mem.reform.in_place is None
            and snap.progress_event in WORKING):
        kind, since = mem.life.recovering
        took = round(snap.now - since, 3)
        mem = mem.but(recovering=None)
        actions = [act(Kind.OBSERVE, metric="recovery_seconds", label=kind, value=took)]
        if records_recovery(snap, kind):
            actions.append(act(Kind.JOURNAL, event="recovered",
                               fields={"fault": kind, "duration_s": took}))
        notes.append(f"training resumed {took:.1f} s after a {kind}")
    return mem, actions, "; ".join(notes)


def restart_cause(now: float, membership_changed_at: float, progress_event: str | None,
                  window_s: float) -> str:
    """Why the agent restarted its workers: ``membership`` (a peer left or joined, a drain,
    our own eviction) or ``crash``. Only crashes count against the restart budget."""
    if progress_event in ("stopped", "peer-unfit"):
        # A coordinated stop (someone is leaving or joining), or a peer node that could
        # not resume the job (trainer.fitness: its own daemon leaves it).
        return "membership"
    if now - membership_changed_at <= window_s:
        return "membership"
    return "crash"


def worker_restarts(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Notice the agent replacing its workers and classify why."""
    if not snap.workers or snap.workers == mem.life.workers:
        return mem, [], ""
    restarted = bool(mem.life.workers)
    # A group that never stepped while a peer was unreachable failed on that peer: its
    # start (group init, the resume's collectives) waited on it. Not this node's crash.
    never_stepped_on_a_peer = mem.life.step_at is None and mem.peer.unreachable
    # torch counts only failure restarts: the same count is a membership change it saw
    # (a node joined the rendezvous), though no record of ours says so yet (CI: a joiner
    # a moment after the first round closed read as a crash on the other nodes).
    uncounted = (mem.life.workers_restart_count is not None
                 and snap.workers_restart_count == mem.life.workers_restart_count)
    # A new worker group steps from scratch: the hang timer waits for its first step.
    mem = mem.but(workers=snap.workers, step_at=None, step=snap.step, workers_at=snap.now,
                  reformed_without=frozenset(), workers_restart_count=snap.workers_restart_count)
    if not restarted:
        return mem, [], ""
    cause = "membership" if never_stepped_on_a_peer or uncounted else restart_cause(
        snap.now, mem.peer.membership_changed_at, snap.progress_event, policy.membership_window_s)
    if cause == "crash":
        mem = begin_recovery(_count_failure(mem, mem.life.failures, snap.now), "worker-crash", snap.now)
    actions = [act(Kind.COUNT, metric="worker_restarts", label=cause)]
    # A membership restart restarts every node's workers: the rank-0 node journals it.
    if records_recovery(snap, "worker-crash" if cause == "crash" else cause):
        actions.insert(0, act(Kind.JOURNAL, event="workers-restarted", fields={"cause": cause}))
    said = "membership change" if cause == "membership" else cause
    return mem, actions, f"the agent restarted its workers after a {said}"


def signals(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """A drain request is remembered once; its deadline is set when the drain starts."""
    if snap.stop_signals >= 2 and not mem.life.hard_stop:
        mem = mem.but(hard_stop=True)
    if snap.drain_request is not None and mem.life.drain_reason is None:
        mem = mem.but(drain_reason=snap.drain_request)
    return mem, [], ""


def hard_stop(snap: Snapshot, mem: Memory, policy: Policy):
    if not mem.life.hard_stop:
        return None
    return (change_phase(mem, Phase.STOPPED), [act(Kind.KILL_AGENT)],
            "a second stop signal arrived; stopping now without a checkpoint")


def drain_grace(now: float, policy: Policy, notice_deadline: float | None) -> float:
    """The drain's grace: ``drain_grace_s``, cut to the notice's deadline minus a margin."""
    grace = policy.drain_grace_s
    if notice_deadline is not None:
        grace = min(grace, max(notice_deadline - now - policy.notice_margin_s, 1.0))
    return grace


def drains_in_place(snap: Snapshot, mem: Memory, policy: Policy) -> bool:
    """Whether this node can leave without stopping the others: in-place mode, workers in
    a live world that report their generation (they take planned changes), and no other
    change of that world under way, other nodes in it (a world of this node alone just
    stops), and the agreement's base known (``generation.base_of``). Else the drain stops
    every rank (a coordinated stop) and torchrun restarts the others' workers in a round
    without this node."""
    if not (policy.recovery_mode == IN_PLACE and mem.phase is Phase.RUNNING
            and agent_running(snap) and bool(snap.workers) and snap.generation is not None
            and snap.world is not None and snap.world.world_size > snap.world.nproc
            and mem.life.step_at is not None and mem.reform.in_place is None
            and mem.peer.isolated_since is None):
        return False
    # The agreement's base must be known: right after a world forms, the peers may not
    # have published their part of it yet (seen: a drain at step 1 fell back).
    views = [snap.world, *(p.world for p in snap.peers.values() if p.world is not None)]
    return base_of(snap.generation_record, views, snap.generation) is not None


def drain(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase is Phase.DRAINING:
        return _draining(snap, mem, policy)
    if mem.life.drain_reason is None:
        return None
    grace = drain_grace(snap.now, policy, snap.notice_deadline)
    in_place = drains_in_place(snap, mem, policy)
    mem = change_phase(mem, Phase.DRAINING, drain_deadline=snap.now + grace, drain_since=snap.now,
                       drain_in_place=in_place)
    actions = [act(Kind.PUBLISH, fields={"state": "leaving"}),
               act(Kind.JOURNAL, event="node-draining", fields={
                   "reason": mem.life.drain_reason, "grace_s": round(grace, 1), "in_place": in_place}),
               act(Kind.NOTIFY, what="stopping")]
    how = "in place" if in_place else "by a coordinated stop"
    actions += ([act(Kind.DRAIN_IN_PLACE, generation=snap.generation)] if in_place
                else _stop_every_rank(snap))
    return mem, actions, f"draining because {mem.life.drain_reason} (grace {grace:.0f} s, {how})"


def _stop_every_rank(snap: Snapshot) -> list[Action]:
    """Today's drain: every rank's coordinated stop, and our agent's end."""
    return [act(Kind.TOUCH_STOP_FILE)] + ([act(Kind.TERMINATE_AGENT)] if agent_running(snap) else [])


def _draining(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.life.drain_in_place:
        out = _draining_in_place(snap, mem, policy)
        if out is not None:
            return out
    actions: list[Action] = []
    if agent_running(snap):
        if not snap.workers and not mem.life.left_rdzv:
            # Our workers are gone: leave the rendezvous now, not after the agent's own
            # shutdown (waiting for it cost the others 1-2 s). In place our agent goes too:
            # nothing is left for it to run (the leave file keeps it out of any round).
            if mem.life.drain_in_place:
                return mem.but(left_rdzv=True), [act(Kind.LEAVE_RENDEZVOUS), act(Kind.KILL_AGENT)], \
                    "our workers stopped after the agreed step; leaving the rendezvous"
            return mem.but(left_rdzv=True), [act(Kind.LEAVE_RENDEZVOUS)], \
                "our workers stopped; leaving the rendezvous"
        if mem.life.drain_deadline is not None and snap.now >= mem.life.drain_deadline:
            return mem.but(drain_deadline=None), [act(Kind.KILL_AGENT)], \
                "the drain grace is over; killing the agent"
        return left_out_while_draining(snap, mem)

    if not mem.life.left_rdzv:
        actions.append(act(Kind.LEAVE_RENDEZVOUS))
    took = round(snap.now - mem.life.drain_since, 3) if mem.life.drain_since is not None else None
    actions += [act(Kind.JOURNAL, event="node-left", fields={
                    "step": snap.step, "drain_s": took, "in_place": mem.life.drain_in_place}),
                act(Kind.DELETE_DRAIN_KEY)]
    if took is not None:
        actions.append(act(Kind.OBSERVE, metric="drain_seconds",
                           label="in-place" if mem.life.drain_in_place else "coordinated-stop",
                           value=took))
    return (change_phase(mem, Phase.STOPPED, left_rdzv=True), actions,
            "the agent stopped; leaving the job and exiting")


def _draining_in_place(snap: Snapshot, mem: Memory, policy: Policy):
    """The drain in place: the agreement's outcome, or the fall-back to every rank's
    coordinated stop when the agreement fails or the workers outlast the re-form's bound
    (their exit after the agreed step is ``_draining``'s, as for a coordinated stop)."""
    out = snap.drained
    if out is not None:
        if out.status == "ok":   # the executor's outcome names it in that cycle's line
            return mem.but(generation_handed=out.record.id), [], ""
        return _drain_by_stopping(snap, mem, out.reason or "no in-place generation")
    if not agent_running(snap) or not snap.workers:
        return None
    waited = snap.now - mem.life.drain_since
    if waited >= reform_bound_s(policy, mem, planned=True):
        return _drain_by_stopping(snap, mem, f"our workers had not stopped {waited:.1f} s after "
                                             "the drain began")
    return None


def _drain_by_stopping(snap: Snapshot, mem: Memory, reason: str):
    return (mem.but(drain_in_place=False),
            [act(Kind.COUNT, metric="in_place_recoveries", label="fallback"), *_stop_every_rank(snap)],
            f"the drain in place fell back to a coordinated stop of every rank ({reason})")


def agent_exited(snap: Snapshot, mem: Memory, policy: Policy):
    if snap.agent_exit is None or mem.life.exit_handled:
        return None
    mem = mem.but(exit_handled=True, workers=frozenset(), kill_at=None)
    if mem.peer.isolated_since is not None or mem.life.agent_released:
        # Killed by us (measured: torchrun killed that way can exit 0, which read as the
        # job's completion and stopped the healthy nodes). The fault is the cut, or the
        # member gone from our agent's round: charged to no one's crash budget.
        why = ("this node is cut off from the majority" if mem.peer.isolated_since is not None
               else "we released it from a round with a member that is gone")
        return (change_phase(mem, Phase.BACKOFF, restart_at=snap.now),
                [act(Kind.PUBLISH, fields={"state": "backoff", "agent_pid": None})],
                f"the agent exited with code {snap.agent_exit} because {why} (neither a "
                "completion nor a failure)")
    if snap.agent_exit == 0:
        return (change_phase(mem, Phase.COMPLETED),
                [act(Kind.MARK_COMPLETED), act(Kind.PUBLISH, fields={"state": "completed",
                                                                     "agent_pid": None}),
                 act(Kind.JOURNAL, event="job-completed", fields={"step": snap.step})],
                "the training script finished; recording job completion")
    if snap.job_state == "completed":
        return (change_phase(mem, Phase.COMPLETED), [],
                f"the agent exited {snap.agent_exit} after the job completed elsewhere")
    failures = _recent(mem.life.failures, snap.now, policy)
    count = len(failures) + 1
    if count >= policy.crash_loop_failures:
        return _mark_failed(mem, f"the agent failed {count} times without progress within "
                                 f"{policy.crash_loop_window_s:.0f} s (last exit code "
                                 f"{snap.agent_exit}); marking this node failed", snap.worker_error)
    delay = min(policy.backoff_initial_s * 2 ** (count - 1), policy.backoff_max_s)
    mem = change_phase(_count_failure(begin_recovery(mem, "agent-crash", snap.now), failures,
                                      snap.now), Phase.BACKOFF, restart_at=snap.now + delay)
    return (mem, [act(Kind.PUBLISH, fields={"state": "backoff", "agent_pid": None}),
                  act(Kind.JOURNAL, event="agent-failed", fields={"exit_code": snap.agent_exit})],
            f"the agent exited with code {snap.agent_exit} (failure {count} of "
            f"{policy.crash_loop_failures}); restarting it in {delay:.1f} s")


def _count_failure(mem: Memory, failures: tuple[float, ...], now: float) -> Memory:
    """One more failure; only a step past today's highest clears the count again."""
    return mem.but(failures=(*failures, now), failed_at_mark=mem.life.high_water)


def _recent(times: tuple[float, ...], now: float, policy: Policy) -> tuple[float, ...]:
    return tuple(t for t in times if now - t <= policy.crash_loop_window_s)


def _mark_failed(mem: Memory, reason: str, error: str | None = None):
    """FAILED, published and journaled; ``error``: the workers' last exception line (a
    crash loop's cause, which otherwise only ``agent.log`` holds)."""
    if error:
        reason = f"{reason}; the workers' last error: {error}"
    extra = {"last_error": error} if error else {}
    return (change_phase(mem, Phase.FAILED),
            [act(Kind.PUBLISH, fields={"state": "failed", "reason": reason, "agent_pid": None}),
             act(Kind.JOURNAL, event="node-failed", fields={"reason": reason, **extra})], reason)


def job_completed(snap: Snapshot, mem: Memory, policy: Policy):
    if snap.job_state != "completed":
        return None
    seen = mem.life.completed_seen_at if mem.life.completed_seen_at is not None else snap.now
    mem = mem.but(completed_seen_at=seen)
    if not agent_running(snap):
        return change_phase(mem, Phase.COMPLETED), [], "the job completed; nothing left to run"
    waited = snap.now - seen
    if waited >= policy.completion_grace_s:
        return (change_phase(mem, Phase.COMPLETED), [act(Kind.KILL_AGENT)],
                f"the job completed {waited:.0f} s ago but the agent still runs; stopping it")
    return mem, [], ""


def reopen(snap: Snapshot, mem: Memory, policy: Policy):
    """torch closes the rendezvous when an agent gives up; an unfinished job must go on.

    An agent also closes it on success (its handler's shutdown): once our own workers
    report the job completed, a closed rendezvous is the end, not a fault (reopening it
    there warned on every normal completion, the daemons' /state not yet written)."""
    if (not snap.rdzv_closed or snap.job_state == "completed" or snap.progress_event == "completed"
            or snap.now < mem.life.reopen_at):
        return None
    return (mem.but(reopen_at=snap.now + 1.0), [act(Kind.REOPEN_RENDEZVOUS)],
            "the rendezvous is closed but the job is not done; reopening it")


def hang_bound(policy: Policy, intervals: tuple[float, ...]) -> float:
    """Seconds without a step that count as a hang."""
    if policy.hang_timeout_s > 0:
        return policy.hang_timeout_s
    if not intervals:
        return policy.hang_floor_s
    return max(policy.hang_floor_s, policy.hang_factor * statistics.median(intervals))


def diverged(snap: Snapshot, mem: Memory, policy: Policy):
    """The workers stopped on a loss that stayed non-finite (``trainer.divergence``):
    restarting them would resume the last checkpoint and diverge again, so the node is
    marked failed at once, saying why and what to change."""
    if mem.phase is not Phase.RUNNING or snap.progress_event != "diverged":
        return None
    reason = (f"training diverged at step {snap.step} (the agreed loss stayed non-finite); a "
              "restart would resume the last checkpoint and diverge again, so this node is "
              "marked failed: lower the learning rate ([lr] rule / base_world_size, or the "
              "script's), then start the job again")
    mem, actions, reason = _mark_failed(mem, reason)
    return mem, [act(Kind.JOURNAL, event="training-diverged", fields={"step": snap.step}),
                 *actions], reason


def unfit(snap: Snapshot, mem: Memory, policy: Policy):
    """Our workers found that this node cannot resume the job (``trainer.fitness``: its
    checkpoint directory lacks the job's newest commit, or its load failed here alone).
    The fault is this node's: it leaves the job (the others restart without it, counting
    no crash) instead of dragging every node through its restarts."""
    if mem.phase is not Phase.RUNNING or snap.progress_event != "unfit":
        return None
    why = snap.progress_reason or "see the workers' log"
    reason = (f"this node's workers cannot resume the job: {why}; this node leaves the job "
              "so that the others go on without it")
    mem, actions, reason = _mark_failed(mem, reason)
    return mem, [act(Kind.JOURNAL, event="node-unfit", fields={"step": snap.step,
                                                               "reason": snap.progress_reason}),
                 *actions], reason


def _start_hang(snap: Snapshot, mem: Memory, policy: Policy):
    """Workers that never made their first step within ``start_timeout_s`` of starting
    (group init, the resume's collectives, a checkpoint load stuck on storage): before, a
    hang there ended only at gloo's 120 s or never (NCCL), since the hang timer arms at
    the first step. Killed; the restart is this node's crash unless a peer was
    unreachable (``worker_restarts``)."""
    if mem.life.workers_at is None or snap.now - mem.life.workers_at < policy.start_timeout_s:
        return None
    waited = snap.now - mem.life.workers_at
    mem = begin_recovery(mem.but(workers_at=None), "hang", snap.now)
    reason = (f"the workers made no first step {waited:.0f} s after they started (bound "
              f"{policy.start_timeout_s:.0f} s: group init, the resume, a checkpoint load); "
              "killing them")
    return mem, [act(Kind.KILL_WORKERS, pids=snap.workers),
                 act(Kind.JOURNAL, event="start-hang", fields={"waited_s": round(waited, 1),
                                                               "step": snap.step})], reason


def hang(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase is not Phase.RUNNING or not snap.workers:
        return None
    if mem.life.step_at is None:
        # A newcomer waits to be admitted: the join's own bounds (supervisor.joining).
        return None if mem.life.joining is not None else _start_hang(snap, mem, policy)
    peer = mem.peer
    if peer.dead or peer.evicting or peer.suspects or peer.kill_at is not None or mem.reform.in_place:
        return None  # a peer loss explains the stall
    stalled = snap.now - mem.life.step_at
    bound = hang_bound(policy, mem.life.intervals)
    if stalled < bound:
        return None
    # No failure is counted here: the agent's restart of the killed workers is one.
    mem = begin_recovery(mem.but(step_at=None), "hang", snap.now)
    reason = (f"training hung: no step for {stalled:.0f} s (bound {bound:.0f} s) while the "
              "workers are alive; killing them to recover as from a crash")
    return mem, [act(Kind.KILL_WORKERS, pids=snap.workers),
                 act(Kind.JOURNAL, event="training-hang", fields={"stalled_s": round(stalled, 1),
                                                                  "step": snap.step})], reason


def worker_crash_loop(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase is not Phase.RUNNING or not agent_running(snap):
        return None
    recent = _recent(mem.life.failures, snap.now, policy)
    if len(recent) < policy.crash_loop_failures:
        return None
    return _mark_failed(mem, f"the workers crashed {len(recent)} times without progress within "
                             f"{policy.crash_loop_window_s:.0f} s; marking this node failed",
                        snap.worker_error)


def start(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase not in (Phase.IDLE, Phase.BACKOFF) or agent_running(snap):
        return None
    if snap.now < mem.life.restart_at:
        return None
    if snap.warm_server == "importing" and snap.warm_server_age_s < policy.warm_agent_wait_s:
        # Forked by the server, the agent skips its own ``import torch`` (2.8 s here, more
        # on a node whose cores the job keeps busy); the server started with the daemon,
        # so what is left of its imports is shorter than that.
        if mem.life.warm_wait_said:
            return mem, [], ""
        # A join in place says now that our newcomers will come: a warm newcomer of
        # another node waits for them (join_batch_s) to enter as one generation.
        soon = entering(snap, joins_in_place(snap, mem, policy), policy, warm=False)
        return mem.but(warm_wait_said=True), soon, (
            f"waiting for the warm-start server's imports ({snap.warm_server_age_s:.1f} s in) "
            "to start the torchrun agent there")
    verb = "restarting" if mem.phase is Phase.BACKOFF else "starting"
    live = joins_in_place(snap, mem, policy)
    actions = [act(Kind.START_AGENT, enter=live), *entering(snap, live, policy, warm=False)]
    if not mem.life.ready_sent:
        actions.append(act(Kind.NOTIFY, what="ready"))
    mem = change_phase(mem, Phase.RUNNING, exit_handled=False, agent_released=False,
                  round_broken_since=None, workers=frozenset(), step_at=None, workers_at=None,
                  ready_sent=True, reformed_without=frozenset(), joining=live, warm_wait_said=False,
                  joining_since=snap.now if live is not None else None, join_proposed=False,
                  join_agreed_at=None, join_warm_at=None)
    how = f" to enter generation {live} in place (its workers start as newcomers)" if live else ""
    return mem, actions, f"{verb} the torchrun agent{how}"
