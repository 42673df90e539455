"""The daemon's decisions: one pure function from a snapshot to one action.

The daemon's loop reads a ``View`` (agent, etcd, peers, signals), calls
``decide`` and executes the returned ``Decision``, then logs its ``reason``:
one sentence per decision. Nothing here does I/O, so every transition is
unit-tested without processes or network.

Phases and their edges::

    IDLE ──start──▶ RUNNING ──exit 0──▶ COMPLETED
      ▲                │ └──exit ≠ 0──▶ BACKOFF ──delay over──▶ (start) RUNNING
      │                │                   └──crash loop──▶ FAILED
      │                └──dead peer──▶ RUNNING (evict it, restart local workers)
    any non-final ──drain──▶ DRAINING ──agent gone──▶ STOPPED
    any non-final ──job completed elsewhere, agent gone──▶ COMPLETED
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Phase(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    BACKOFF = "backoff"
    DRAINING = "draining"
    COMPLETED = "completed"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def final(self) -> bool:
        return self in (Phase.COMPLETED, Phase.FAILED, Phase.STOPPED)


class Action(enum.Enum):
    NONE = "none"
    START_AGENT = "start_agent"
    EVICT_PEERS = "evict_peers"
    BACKOFF = "backoff"
    MARK_FAILED = "mark_failed"
    RECORD_COMPLETED = "record_completed"
    STOP_COMPLETED = "stop_completed"
    DRAIN = "drain"
    FINISH_DRAIN = "finish_drain"


@dataclass(frozen=True)
class Policy:
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    crash_loop_failures: int = 5
    crash_loop_window_s: float = 600.0
    completion_grace_s: float = 30.0


@dataclass(frozen=True)
class View:
    """Everything one decision may look at, read once per cycle."""

    now: float
    phase: Phase
    agent_running: bool = False
    agent_exit: int | None = None          # set once, in the cycle the agent was seen to exit
    job_state: str | None = None           # etcd: running | completed | failed
    completed_seen_at: float | None = None  # when this node first saw job_state completed
    restart_at: float = 0.0                # end of the current backoff
    failures: tuple[float, ...] = ()       # crash times (agent or workers) since the last progress
    dead_peers: tuple[str, ...] = ()
    drain_reason: str | None = None


@dataclass(frozen=True)
class Decision:
    action: Action
    phase: Phase
    reason: str
    delay_s: float = 0.0
    peers: tuple[str, ...] = field(default=())


def decide(view: View, policy: Policy) -> Decision:
    """The single decision for this cycle; first matching rule wins."""
    for rule in _RULES:
        decision = rule(view, policy)
        if decision is not None:
            return decision
    return Decision(Action.NONE, view.phase, f"{view.phase.value}: nothing to do")


def _final(view: View, policy: Policy) -> Decision | None:
    if view.phase.final:
        return Decision(Action.NONE, view.phase, f"{view.phase.value}: the daemon is done")
    return None


def _draining(view: View, policy: Policy) -> Decision | None:
    if view.phase is Phase.DRAINING:
        if view.agent_running:
            return Decision(Action.NONE, Phase.DRAINING, "draining: waiting for the agent to stop")
        return Decision(Action.FINISH_DRAIN, Phase.STOPPED,
                        "the agent stopped; leaving the job and exiting")
    if view.drain_reason is not None:
        return Decision(Action.DRAIN, Phase.DRAINING, f"draining because {view.drain_reason}")
    return None


def _agent_exited(view: View, policy: Policy) -> Decision | None:
    if view.agent_exit is None:
        return None
    if view.agent_exit == 0:
        return Decision(Action.RECORD_COMPLETED, Phase.COMPLETED,
                        "the training script finished; recording job completion")
    if view.job_state == "completed":
        return Decision(Action.NONE, Phase.COMPLETED,
                        f"the agent exited {view.agent_exit} after the job completed elsewhere")
    failures = [t for t in view.failures if view.now - t <= policy.crash_loop_window_s]
    count = len(failures) + 1
    if count >= policy.crash_loop_failures:
        return Decision(Action.MARK_FAILED, Phase.FAILED,
                        f"the agent failed {count} times without progress within "
                        f"{policy.crash_loop_window_s:.0f} s (last exit code {view.agent_exit}); "
                        "marking this node failed")
    delay = min(policy.backoff_initial_s * 2 ** (count - 1), policy.backoff_max_s)
    return Decision(Action.BACKOFF, Phase.BACKOFF,
                    f"the agent exited with code {view.agent_exit} (failure {count} of "
                    f"{policy.crash_loop_failures}); restarting it in {delay:.1f} s", delay_s=delay)


def _worker_crash_loop(view: View, policy: Policy) -> Decision | None:
    if view.phase is not Phase.RUNNING or not view.agent_running:
        return None
    recent = [t for t in view.failures if view.now - t <= policy.crash_loop_window_s]
    if len(recent) < policy.crash_loop_failures:
        return None
    return Decision(Action.MARK_FAILED, Phase.FAILED,
                    f"the workers crashed {len(recent)} times without progress within "
                    f"{policy.crash_loop_window_s:.0f} s; marking this node failed")


def restart_cause(now: float, last_membership_change: float, progress_event: str | None,
                  window_s: float = 15.0) -> str:
    """Why the agent restarted its workers: ``membership`` (a peer left or joined, a drain,
    our own eviction) or ``crash``. Only crashes count against the restart budget."""
    if progress_event == "stopped":
        return "membership"   # a coordinated stop: someone is leaving or joining
    if now - last_membership_change <= window_s:
        return "membership"
    return "crash"


def _job_completed(view: View, policy: Policy) -> Decision | None:
    if view.job_state != "completed":
        return None
    if not view.agent_running:
        return Decision(Action.NONE, Phase.COMPLETED, "the job completed; nothing left to run")
    waited = view.now - (view.completed_seen_at or view.now)
    if waited >= policy.completion_grace_s:
        return Decision(Action.STOP_COMPLETED, Phase.COMPLETED,
                        f"the job completed {waited:.0f} s ago but the agent still runs; stopping it")
    return None


def _dead_peers(view: View, policy: Policy) -> Decision | None:
    if not view.dead_peers:
        return None
    names = ", ".join(view.dead_peers)
    if view.phase is Phase.RUNNING:
        return Decision(Action.EVICT_PEERS, Phase.RUNNING,
                        f"peer(s) {names} lost; evicting them from the rendezvous and restarting "
                        "the local workers now", peers=view.dead_peers)
    return Decision(Action.EVICT_PEERS, view.phase,
                    f"peer(s) {names} lost; evicting them from the rendezvous", peers=view.dead_peers)


def _start(view: View, policy: Policy) -> Decision | None:
    if view.phase not in (Phase.IDLE, Phase.BACKOFF) or view.agent_running:
        return None
    if view.job_state == "failed":
        return Decision(Action.NONE, Phase.FAILED, "the job is marked failed; not starting the agent")
    if view.now < view.restart_at:
        return None
    verb = "restarting" if view.phase is Phase.BACKOFF else "starting"
    return Decision(Action.START_AGENT, Phase.RUNNING, f"{verb} the torchrun agent")


_RULES = (_final, _draining, _agent_exited, _job_completed, _dead_peers, _worker_crash_loop, _start)
