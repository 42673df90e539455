"""The daemon's decisions: one pure function from what it saw to what it does next.

Each cycle the daemon reads a ``Snapshot`` (its agent and workers, the progress
file, the etcd view, probe news, signals), and calls
``decide(snapshot, memory, policy)``. The result is the next ``Memory`` (the
daemon's own state across cycles: phase, timers, counters), the ``Action`` list
to execute and one sentence saying why. Nothing here does I/O or reads a clock,
so every rule, timers included, is unit-tested without processes or network
(``tests/daemon/test_supervisor.py``).

A cycle first does the bookkeeping that every phase needs (``_BOOKKEEPING``, in
order: signals, an in-place re-form under way, progress and the crash counter, worker
restarts and their cause, peer news (vanished records, confirmations), this node's
suspicions and the majority's verdicts (``quorum``), the shrink's and the eviction's
outcomes, kills due, generation news, the world to publish, the checkpoint hint, the
periodic journal entry), then applies the first matching phase rule (``_RULES``).
Phases and their edges::

    IDLE ──start──▶ RUNNING ──exit 0──▶ COMPLETED
                       │ └──exit ≠ 0──▶ BACKOFF ──delay over──▶ (start) RUNNING
                       ├──crash loop──▶ FAILED (the agent's exit or the worker restart that
                       │                 is the crash_loop_failures-th crash in the window)
                       ├──dead peer──▶ RUNNING (evict it; kill the old world's workers, or
                       │                 in-place mode: agree the next generation, the
                       │                 workers re-form; a re-form that fails or takes
                       │                 too long falls back to the kill)
                       ├──cut off from the majority──▶ (kill our agent) BACKOFF, held until
                       │                 the majority is reached again; never a failure
                       ├──our agent's round names a gone agent──▶ (kill our agent) BACKOFF,
                       │                 restarted at once; never a failure
                       ├──training hang──▶ RUNNING (kill our workers: a crash)
                       ├──loss diverged──▶ FAILED (a restart would diverge again)
                       └──this node cannot resume──▶ FAILED (it leaves; the others go on)
    IDLE, RUNNING, BACKOFF ──drain──▶ DRAINING ──agent gone──▶ STOPPED
    any non-final ──job completed elsewhere, agent gone──▶ COMPLETED
    any non-final ──second stop signal──▶ STOPPED (hard)

FAILED is entered from RUNNING only (``_agent_exited``, ``_worker_crash_loop``,
``_diverged``, ``_unfit``): no rule fails a node in BACKOFF. The same edges are
``PHASE_EDGES``; ``change_phase`` is the one way a rule changes the phase.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from elasticd import quorum
from elasticd.actions import Action, Kind, act
from elasticd.contract.generation import GenerationId, GenerationRecord, WorldView
from elasticd.contract.progress import WORKING, Reform
from elasticd.contract.settings import DEFAULT_RECOVERY, IN_PLACE, RecoveryMode
from elasticd.inplace import loss
from elasticd.inplace.agreement import ShrinkOutcome


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


# Every phase change the rules make (the module docstring's diagram): a change not listed
# is a bug in a rule, refused by ``change_phase`` rather than acted on.
_NOT_FINAL_EXITS = frozenset({Phase.DRAINING, Phase.COMPLETED, Phase.STOPPED})
PHASE_EDGES: Mapping[Phase, frozenset[Phase]] = MappingProxyType({
    Phase.IDLE: _NOT_FINAL_EXITS | {Phase.RUNNING},
    Phase.RUNNING: _NOT_FINAL_EXITS | {Phase.BACKOFF, Phase.FAILED},
    Phase.BACKOFF: _NOT_FINAL_EXITS | {Phase.RUNNING},
    Phase.DRAINING: frozenset({Phase.COMPLETED, Phase.STOPPED}),
    Phase.COMPLETED: frozenset(), Phase.FAILED: frozenset(), Phase.STOPPED: frozenset(),
})


class IllegalPhaseChange(RuntimeError):
    """A rule tried a phase change that ``PHASE_EDGES`` does not allow."""


@dataclass(frozen=True)
class Policy:
    """Every tunable of the decisions (from ``[supervisor]``; see config.py)."""

    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    crash_loop_failures: int = 5
    crash_loop_window_s: float = 600.0
    completion_grace_s: float = 30.0
    # After a crashed (or departed) peer gloo fails our workers within ~0.1 s and rank 0
    # commits the last completed step; killing them at once raced that save (measured:
    # 17 steps lost). A silent peer leaves them hung in a collective: killed at once.
    kill_grace_s: float = 2.0
    # A worker restart this soon after a membership change is caused by it, not a crash.
    membership_window_s: float = 15.0
    # A vanished peer whose confirmation probe has not come back by then is silent.
    confirm_timeout_s: float = 1.5
    drain_grace_s: float = 60.0
    # A preemption notice's deadline minus this is the latest the drain may take.
    notice_margin_s: float = 5.0
    # Training hang: no step for max(hang_floor_s, hang_factor x median step time), or
    # hang_timeout_s when set (> 0).
    hang_timeout_s: float = 0.0
    hang_floor_s: float = 120.0
    hang_factor: float = 20.0
    # A worker group with no first step this long after it started hangs in its start.
    start_timeout_s: float = 600.0
    # The rank-0 node journals a progress point this often (timelines of real jobs).
    progress_every_s: float = 30.0
    # [recovery] mode: IN_PLACE re-forms the survivors' group after a lost peer; RESTART
    # kills them for torchrun. The config's default (contract.settings.DEFAULT_RECOVERY).
    recovery_mode: RecoveryMode = DEFAULT_RECOVERY
    # The workers' re-form bound; the daemon waits IN_PLACE_SLACK_S more, then kills them.
    recovery_bound_s: float = 5.0
    # A peer whose probes go unanswered this long is suspected (a refusal: at once); the
    # daemon's default is its lease TTL, the time etcd takes to decide the same.
    silent_suspect_s: float = 5.0
    # A round whose world names an agent no live record has (its node gone, condemned, or
    # its agent replaced) is waited in for this long before our agent is released from it
    # (a record that names a peer's new agent may be that much behind its round).
    broken_round_grace_s: float = 2.0
    # False: our agent waits in such a round until torchrun's own store timeout (torch's
    # behaviour; for comparisons and the liveness invariant's weakened run).
    release_broken_rounds: bool = True


@dataclass(frozen=True)
class PeerView:
    """A peer's record as last seen (validated by membership; see ``Peer``)."""

    node_id: str
    state: str = "running"
    agent: tuple[str, int] | None = None
    mod_revision: int = 0
    probe: str | None = None               # HOST:PORT of its liveness probe
    world: WorldView | None = None         # its workers' world, as its record says
    store: str | None = None               # HOST:PORT of its daemon's TCP store
    suspects: frozenset[str] = frozenset()  # the peers it suspects dead (elasticd.quorum)


@dataclass(frozen=True)
class Eviction:
    """What the last EVICT did.

    ``ok`` False: etcd did not answer (retry). ``in_round``: whether an agent we
    removed was in the current round; None when we removed nothing (another daemon
    was first), so the peer's last record has to tell.
    """

    peers: tuple[str, ...]
    ok: bool
    in_round: bool | None = None


@dataclass(frozen=True)
class Snapshot:
    """Everything one decision may look at, read once per cycle."""

    now: float
    agent_pid: int | None = None           # the current agent process, running or exited
    agent_exit: int | None = None          # its exit code once it has exited
    workers: frozenset[int] = frozenset()  # the agent's worker pids
    # torch's count of failure restarts these workers were started with (their
    # TORCHELASTIC_RESTART_COUNT; None: unreadable): a membership restart keeps it.
    workers_restart_count: int | None = None
    step: int | None = None                # progress file: last completed step ...
    progress_event: str | None = None      # ... and its event (step, checkpoint, stopped, ...)
    progress_reason: str | None = None     # ... and why, where the event says (unfit, ...)
    job_state: str | None = None           # etcd: running | completed
    drain_request: str | None = None       # why a drain was asked (signal, `elasticd drain`, notice)
    notice_deadline: float | None = None   # when a preemption notice says the node is taken
    stop_signals: int = 0                  # SIGTERM/SIGINT received so far
    rdzv_closed: bool = False              # torch marked the rendezvous closed
    round: int | None = None               # the rendezvous' newest round ...
    round_members: frozenset[tuple[str, int]] = frozenset()  # ... its agents (keyed rounds)
    agent_addr: str = ""                   # the address our agent joins with
    peers: Mapping[str, PeerView] = field(default_factory=dict)
    refused: tuple[PeerView, ...] = ()     # peers whose liveness probe was refused
    probe_answers: Mapping[str, str] = field(default_factory=dict)  # node -> alive|refused|silent
    departed: tuple[PeerView, ...] = ()    # peers whose record vanished
    confirmations: Mapping[str, str] = field(default_factory=dict)  # node -> alive|refused|silent
    eviction: Eviction | None = None
    checkpoint_step: int | None = None     # newest committed checkpoint (background scan)
    rank0_here: bool = False               # this node's workers include global rank 0
    node_id: str = ""
    generation: GenerationId | None = None  # progress file: our workers' generation ...
    world: WorldView | None = None         # ... their world as this node publishes it ...
    reform: Reform | None = None           # ... and a re-form's report
    shrink: ShrinkOutcome | None = None    # the last SHRINK's outcome
    generation_record: GenerationRecord | None = None  # etcd: the agreed generation
    worker_error: str | None = None        # agent log: the workers' newest exception line


@dataclass(frozen=True)
class Death:
    peer: PeerView
    how: str          # left | crashed | silent
    attempts: int = 0  # evictions tried (etcd may be down)


@dataclass(frozen=True)
class InPlace:
    """An in-place re-form under way, from the loss decision until the workers report."""

    lost: tuple[str, ...]
    since: float
    base: GenerationId        # our workers' generation when the loss was decided
    fault: str                # peer-crashed | peer-silent | peer-left
    agreed: bool = False      # a record naming us was agreed and handed to the workers


@dataclass(frozen=True)
class Memory:
    """The daemon's state across cycles; ``decide`` returns the next one."""

    phase: Phase = Phase.IDLE
    failures: tuple[float, ...] = ()       # crash times since the last progress
    high_water: int = -1                   # the highest step the workers ever reported
    failed_at_mark: int = -1               # high_water when the last failure was counted
    restart_at: float = 0.0                # end of the current backoff
    membership_changed_at: float = float("-inf")
    peers_seen: frozenset[str] = frozenset()
    suspects: Mapping[str, tuple[PeerView, float]] = field(default_factory=dict)
    dead: Mapping[str, Death] = field(default_factory=dict)      # to evict
    evicting: Mapping[str, Death] = field(default_factory=dict)  # EVICT sent, outcome pending
    kill_at: float | None = None           # crashed peer: kill the old world's workers then ...
    kill_pids: frozenset[int] = frozenset()  # ... if these are still alive
    agent_pid: int | None = None           # the agent whose exit was handled is not re-handled
    exit_handled: bool = False
    workers: frozenset[int] = frozenset()
    workers_restart_count: int | None = None  # the Snapshot's, for the workers above
    step: int | None = None
    step_at: float | None = None           # when the current workers last advanced the step
    workers_at: float | None = None        # when the current worker group appeared
    intervals: tuple[float, ...] = ()      # recent step intervals (hang bound)
    drain_reason: str | None = None
    drain_deadline: float | None = None
    left_rdzv: bool = False
    evict_at: float = 0.0                  # earliest retry of a failed eviction
    reopen_at: float = 0.0                 # earliest retry of a reopen
    completed_seen_at: float | None = None
    published_checkpoint: int | None = None
    ready_sent: bool = False
    hard_stop: bool = False
    recovering: tuple[str, float] | None = None   # (what broke, since when) until the next step
    refused_at: Mapping[str, float] = field(default_factory=dict)  # last refused probe per peer
    journaled_at: float = float("-inf")    # last periodic progress entry
    published_world: WorldView | None = None
    in_place: InPlace | None = None
    generation_handed: GenerationId | None = None  # newest record handed to our workers
    # Peers the current worker group already re-formed without: the EVICT's outcome can
    # come after the re-form (measured: re-formed 0.1 s after the crash), and must not kill
    # them then. It belongs to that group: a new group (a restart, a new agent) starts
    # empty, or a peer re-formed out once, back, and lost again before the new group's
    # first step would get no kill (its survivors hung until the collective timeout).
    reformed_without: frozenset[str] = frozenset()
    # elasticd.quorum: this node's own suspicions (node -> (how, since)), published in its
    # record; when its probes of each peer first went unanswered; the peers a majority
    # condemned, with the agent their record named then (``_held_verdicts``: acted on
    # once); since when this node is cut off from the majority (it then stops its
    # workers and waits).
    suspicions: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    silent_since: Mapping[str, float] = field(default_factory=dict)
    published_suspects: frozenset[str] = frozenset()
    condemned: Mapping[str, tuple[str, int] | None] = field(default_factory=dict)
    isolated_since: float | None = None
    # Since when the round our agent is forming names an agent that is gone; whether we
    # killed our agent to release it from that round (its exit is then no failure).
    round_broken_since: float | None = None
    agent_released: bool = False


@dataclass(frozen=True)
class Decision:
    memory: Memory
    actions: tuple[Action, ...] = ()
    reason: str = ""

    @property
    def phase(self) -> Phase:
        return self.memory.phase

    def kinds(self) -> list[Kind]:
        return [a.kind for a in self.actions]


# A refused probe this recent classifies a vanished peer as crashed without a confirmation.
REFUSED_FRESH_S = 2.0
# After a SHRINK the workers get their own bound plus this (their report's way to us)
# before the daemon kills them (the restart path).
IN_PLACE_SLACK_S = 2.0

# A bookkeeping step or a phase rule: (snapshot, memory, policy) -> (memory, actions, sentence).
Step = Callable[[Snapshot, Memory, Policy], tuple[Memory, list[Action], str]]
Rule = Callable[[Snapshot, Memory, Policy], "tuple[Memory, list[Action], str] | None"]


def decide(snap: Snapshot, mem: Memory, policy: Policy) -> Decision:
    """The next memory, the actions of this cycle and one sentence saying why."""
    if mem.phase.final:
        return Decision(mem)
    actions: list[Action] = []
    notes: list[str] = []
    for step in _BOOKKEEPING:
        mem, more, note = step(snap, mem, policy)
        actions += more
        if note:
            notes.append(note)
    for rule in _RULES:
        out = rule(snap, mem, policy)
        if out is not None:
            mem, more, note = out
            actions += more
            if note:
                notes.insert(0, note)   # the phase decision leads the sentence
            break
    return Decision(mem, tuple(actions), "; ".join(notes))


def change_phase(mem: Memory, phase: Phase, **changes: Any) -> Memory:
    """``mem`` in ``phase`` (and ``changes``): the one way a rule changes the phase, checked
    against ``PHASE_EDGES`` (as Supervisor's ``change_state`` checks its table)."""
    if phase not in PHASE_EDGES[mem.phase]:
        raise IllegalPhaseChange(f"{mem.phase.value} -> {phase.value} is not a phase change "
                                 "the daemon makes (supervisor.PHASE_EDGES)")
    return replace(mem, phase=phase, **changes)


# -- bookkeeping -----------------------------------------------------------------------


def _progress(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Track the step; a step past the highest one reached before the last failure
    ends a crash loop, and the first completed step after a fault ends its recovery
    (timed).

    New ground, not any step: a restart resumes a checkpoint behind the failure, so
    "stepped since the start" let a loop that fails at the same step every time (a
    bad sample, a diverging model) clear its count forever (found by the goodput run)."""
    if snap.step is None or snap.step == mem.step:
        return mem, [], ""
    intervals = mem.intervals
    if mem.step_at is not None:
        intervals = (*intervals, snap.now - mem.step_at)[-20:]
    cleared = bool(mem.failures) and snap.step > mem.failed_at_mark
    mem = replace(mem, step=snap.step, step_at=snap.now, intervals=intervals,
                  high_water=max(mem.high_water, snap.step),
                  failures=() if cleared else mem.failures)
    notes = ["training progressed past the last failure; the crash count is reset"] if cleared else []
    actions: list[Action] = []
    if (mem.recovering is not None and mem.in_place is None
            and snap.progress_event in WORKING):
        kind, since = mem.recovering
        took = round(snap.now - since, 3)
        mem = replace(mem, recovering=None)
        actions = [act(Kind.OBSERVE, metric="recovery_seconds", label=kind, value=took)]
        if records_recovery(snap, kind):
            actions.append(act(Kind.JOURNAL, event="recovered",
                               fields={"fault": kind, "duration_s": took}))
        notes.append(f"training resumed {took:.1f} s after a {kind}")
    return mem, actions, "; ".join(notes)


# The node-record states of a node that is no longer in the job (or leaving it): not live.
GONE_STATES = frozenset({"leaving", "completed", "failed"})
# Faults of this node alone (its own workers, agent or hang): only this node can tell them.
LOCAL_FAULTS = frozenset({"worker-crash", "agent-crash", "hang"})


def records_loss(snap: Snapshot, mem: Memory, lost: Collection[str]) -> bool:
    """Whether this node journals the loss of ``lost``: every survivor decides the same loss,
    and one entry per fault (not one per node: 2,047 writes at 2,048 nodes) is written by
    the survivor whose workers hold the lowest rank, as the nodes' records publish their
    worlds (by node id where a world is unknown). Every survivor reads the same records,
    so they name the same writer; a survivor that sees a peer the others already lost may
    write a second entry. None is written only when the lower-ranked peer they defer to
    dies before the loss is journaled (its own loss is then journaled by the next one)."""
    gone = set(lost) | set(mem.dead) | set(mem.evicting) | set(mem.refused_at)

    def key(node: str, world: WorldView | None) -> tuple[float, str]:
        return (world.first_rank if world is not None else float("inf"), node)

    mine = key(snap.node_id, snap.world)
    return all(mine <= key(n, p.world) for n, p in snap.peers.items()
               if n not in gone and n != snap.node_id and p.state not in GONE_STATES)


def records_recovery(snap: Snapshot, kind: str) -> bool:
    """Whether this node journals a recovery from ``kind``: a fault of this node alone by
    this node; a shared one (a lost peer: every survivor recovers) once, by the node whose
    workers hold rank 0 of the new world (its progress file says so)."""
    return kind in LOCAL_FAULTS or snap.rank0_here


def _recovering(mem: Memory, kind: str, now: float) -> Memory:
    """Start timing a recovery (the first fault of a burst sets the start)."""
    return mem if mem.recovering is not None else replace(mem, recovering=(kind, now))


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


def _worker_restarts(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Notice the agent replacing its workers and classify why."""
    if not snap.workers or snap.workers == mem.workers:
        return mem, [], ""
    restarted = bool(mem.workers)
    # A group that never stepped while a peer was unreachable failed on that peer: its
    # start (group init, the resume's collectives) waited on it. Not this node's crash.
    never_stepped_on_a_peer = mem.step_at is None and peers_unreachable(mem)
    # torch counts only failure restarts: the same count is a membership change it saw
    # (a node joined the rendezvous), though no record of ours says so yet (CI: a joiner
    # a moment after the first round closed read as a crash on the other nodes).
    uncounted = (mem.workers_restart_count is not None
                 and snap.workers_restart_count == mem.workers_restart_count)
    # A new worker group steps from scratch: the hang timer waits for its first step.
    mem = replace(mem, workers=snap.workers, step_at=None, step=snap.step, workers_at=snap.now,
                  reformed_without=frozenset(), workers_restart_count=snap.workers_restart_count)
    if not restarted:
        return mem, [], ""
    cause = "membership" if never_stepped_on_a_peer or uncounted else restart_cause(
        snap.now, mem.membership_changed_at, snap.progress_event, policy.membership_window_s)
    if cause == "crash":
        mem = _recovering(_count_failure(mem, mem.failures, snap.now), "worker-crash", snap.now)
    actions = [act(Kind.COUNT, metric="worker_restarts", label=cause)]
    # A membership restart restarts every node's workers: the rank-0 node journals it.
    if records_recovery(snap, "worker-crash" if cause == "crash" else cause):
        actions.insert(0, act(Kind.JOURNAL, event="workers-restarted", fields={"cause": cause}))
    return mem, actions, f"the agent restarted its workers after a {cause}"


def _peer_news(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Vanished records (etcd decided: the peer's lease expired), confirmations, new peers."""
    actions: list[Action] = []
    notes: list[str] = []
    refused_at = {n: t for n, t in mem.refused_at.items() if snap.now - t < REFUSED_FRESH_S}
    refused_at.update({p.node_id: snap.now for p in snap.refused})
    suspects = dict(mem.suspects)
    dead = dict(mem.dead)
    for peer in snap.departed:
        if peer.node_id in mem.condemned:
            continue   # the majority's verdict was acted on already
        # A refusal moments ago needs no second probe.
        how = loss.departed(peer.state in GONE_STATES,
                            loss.REFUSED if peer.node_id in refused_at else None)
        if how is None:
            suspects[peer.node_id] = (peer, snap.now)
            actions.append(act(Kind.CONFIRM_PEER, peer=peer))
        else:
            dead[peer.node_id] = Death(peer, how)
    for node_id, (peer, since) in list(suspects.items()):
        answer = snap.confirmations.get(node_id)
        if answer is None and snap.now - since < policy.confirm_timeout_s:
            continue
        del suspects[node_id]
        how = loss.departed(False, answer or loss.SILENT)   # no answer in time: silent
        if how == loss.ALIVE:
            notes.append(f"peer {node_id}'s record vanished but it answers; waiting for it to "
                         "re-register")
        else:
            dead[node_id] = Death(peer, how)
    seen = frozenset(snap.peers)
    changed = snap.departed or (seen - mem.peers_seen)
    mem = replace(mem, suspects=suspects, dead=dead, peers_seen=seen, refused_at=refused_at,
                  membership_changed_at=snap.now if changed else mem.membership_changed_at)
    return mem, actions, "; ".join(notes)


def _suspicions(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """This node's suspicions from its probes, published; the majority's verdicts
    (``quorum.condemned``) become deaths once each; whether this node is cut off."""
    mine, silent = _own_suspicions(snap, mem, policy)
    notes = [_suspicion_note(n, mine[n][0]) for n in sorted(set(mine) - set(mem.suspicions))]
    actions: list[Action] = []
    if frozenset(mine) != mem.published_suspects:
        actions.append(act(Kind.PUBLISH, fields={"suspects": sorted(mine)}))
    me, votes = snap.node_id, set(mine)
    condemned = quorum.condemned(me, votes, snap.peers)
    held = _held_verdicts(mem.condemned, condemned, snap.peers)
    dead = dict(mem.dead)
    for node in sorted(condemned - set(held)):
        held[node] = snap.peers[node].agent
        if node not in mem.evicting:
            dead[node] = Death(snap.peers[node], mine.get(node, ("silent", 0.0))[0])
            notes.append(f"a majority of the members suspect peer {node}")
    isolated = quorum.isolated(me, votes, snap.peers)
    if isolated and mem.isolated_since is None:
        notes.append(f"this node reaches {len(snap.peers) + 1 - len(votes & set(snap.peers))} of "
                     f"the {len(snap.peers) + 1} live members: cut off from the majority")
    elif not isolated and mem.isolated_since is not None:
        notes.append("this node reaches the majority again")
    mem = replace(mem, suspicions=mine, silent_since=silent, published_suspects=frozenset(mine),
                  dead=dead, condemned=held,
                  isolated_since=(mem.isolated_since or snap.now) if isolated else None)
    return mem, actions, "; ".join(notes)


def _held_verdicts(verdicts: Mapping[str, tuple[str, int] | None], condemned: frozenset[str],
                   peers: Mapping[str, PeerView]) -> dict[str, tuple[str, int] | None]:
    """The earlier verdicts still in force: a verdict is on one incarnation of a node, so
    it holds while the node has a record and either the majority still suspects it or
    the record still names the agent it was passed on. A node restarted before its
    old lease ran out (its new daemon overwrote the record) is a new member once it
    answers; before, its verdict lived as long as the key, and every round the node
    joined was taken as naming a gone agent (the demo's rejoin in CI: the survivors
    released their agents every few seconds, no world of 3 in 120 s)."""
    return {n: agent for n, agent in verdicts.items()
            if n in peers and (n in condemned or peers[n].agent == agent)}


def _own_suspicions(snap: Snapshot, mem: Memory, policy: Policy
                    ) -> tuple[dict[str, tuple[str, float]], dict[str, float]]:
    """``loss.suspicions`` over this cycle's probes (a refusal seen by the prober counts too)."""
    answers = {**snap.probe_answers, **{p.node_id: loss.REFUSED for p in snap.refused}}
    return loss.suspicions(answers, snap.peers, mem.suspicions, mem.silent_since, snap.now,
                           policy.silent_suspect_s)


def _suspicion_note(node: str, how: str) -> str:
    return (f"peer {node} refused its liveness probe" if how == "crashed"
            else f"peer {node} has not answered its probes")


def _eviction_outcome(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """After an EVICT: plan the kill of the old world's workers; retry a failed eviction."""
    if snap.eviction is None or not mem.evicting:
        return mem, [], ""
    deaths = [mem.evicting[n] for n in snap.eviction.peers if n in mem.evicting]
    evicting = {n: d for n, d in mem.evicting.items() if n not in snap.eviction.peers}
    mem = replace(mem, evicting=evicting, membership_changed_at=snap.now)
    first = [d for d in deaths if d.attempts == 1]
    if not snap.eviction.ok:
        # etcd did not answer: retry in a second. Our workers must not stay in a broken
        # world meanwhile, so the kill is planned now all the same.
        mem = replace(mem, dead={**mem.dead, **{d.peer.node_id: d for d in deaths}},
                      evict_at=snap.now + 1.0)
    if snap.eviction.ok and snap.eviction.in_round is not None:
        in_round = snap.eviction.in_round and bool(first)
    else:
        # A peer whose agent was running was surely in our round.
        in_round = any(d.peer.state == "running" and d.peer.agent for d in first)
    if not in_round or not snap.workers or mem.phase is not Phase.RUNNING:
        return mem, [], ""
    handled = set(mem.in_place.lost if mem.in_place is not None else ()) | mem.reformed_without
    if {d.peer.node_id for d in first} <= handled:
        return mem, [], ""   # the workers re-form in place; the timers below fall back
    if any(d.how == "silent" for d in first):
        return mem, [act(Kind.KILL_WORKERS, pids=snap.workers)], \
            "a silent peer leaves our workers hung in a collective; killing them now"
    if mem.kill_at is None:
        mem = replace(mem, kill_at=snap.now + policy.kill_grace_s, kill_pids=snap.workers)
    return mem, [], ""


def _kill_due(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """The grace after a crashed peer is over: kill workers still in the old world."""
    if mem.kill_at is None or snap.now < mem.kill_at:
        return mem, [], ""
    stuck = mem.kill_pids & snap.workers
    mem = replace(mem, kill_at=None, kill_pids=frozenset())
    if not stuck:
        return mem, [], ""
    return mem, [act(Kind.KILL_WORKERS, pids=stuck)], \
        f"killing {len(stuck)} worker(s) still in the old world after the {policy.kill_grace_s:.0f} s grace"


def _in_place_fallback(snap: Snapshot, mem: Memory, reason: str,
                       duration_s: float | None = None) -> tuple[Memory, list[Action], str]:
    """Give up the in-place re-form: the workers' restart that follows is a membership one."""
    ip = mem.in_place
    took = round(duration_s if duration_s is not None else snap.now - ip.since, 3)
    mem = replace(mem, in_place=None, membership_changed_at=snap.now)
    return mem, [act(Kind.JOURNAL, event="in-place-fallback",
                     fields={"reason": reason, "duration_s": took, "lost": list(ip.lost)}),
                 act(Kind.COUNT, metric="in_place_recoveries", label="fallback")], \
        f"the in-place re-form fell back to a worker restart ({reason})"


def _in_place_done(snap: Snapshot, mem: Memory) -> tuple[Memory, list[Action], str]:
    """The workers report the new generation: one ``recovered-in-place`` event (the
    generic ``recovered`` is cleared with ``recovering``)."""
    ip = mem.in_place
    took = round(snap.now - ip.since, 3)
    reform = snap.reform if snap.reform is not None and snap.reform.event == "reformed" else None
    worker_s = reform.duration_s if reform is not None else None
    fields = {"duration_s": worker_s if worker_s is not None else took, "daemon_s": took,
              "from_world_size": reform.from_world_size if reform is not None else None,
              "world_size": snap.world.world_size if snap.world is not None else None,
              "generation": str(snap.generation), "fault": ip.fault, "lost": list(ip.lost)}
    mem = replace(mem, in_place=None, recovering=None,
                  reformed_without=mem.reformed_without | frozenset(ip.lost))
    actions = [act(Kind.OBSERVE, metric="recovery_seconds", label="in-place", value=took),
               act(Kind.COUNT, metric="in_place_recoveries", label="ok")]
    if records_recovery(snap, ip.fault):
        actions.insert(0, act(Kind.JOURNAL, event="recovered-in-place", fields=fields))
    return mem, actions, \
        f"the workers re-formed in place as generation {snap.generation} {took:.1f} s after a {ip.fault}"


def _in_place(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Watch an in-place re-form: success, the workers' own failure, their exit, or the
    timeout (bound + slack) after which the daemon kills them for torchrun."""
    ip = mem.in_place
    if ip is None:
        return mem, [], ""
    if snap.reform is not None and snap.reform.event == "reform-failed":
        return _in_place_fallback(snap, mem, snap.reform.reason or "reform-failed",
                                  snap.reform.duration_s)
    if snap.generation is not None and snap.generation.newer_than(ip.base):
        # Also when the ``reformed`` record was overwritten by a step before we read it.
        return _in_place_done(snap, mem)
    if ip.agreed and snap.workers != mem.workers:
        return _in_place_fallback(snap, mem, "workers-exited")
    waited = snap.now - ip.since
    if waited < policy.recovery_bound_s + IN_PLACE_SLACK_S:
        return mem, [], ""
    mem, actions, note = _in_place_fallback(snap, mem, "timeout")
    if snap.workers:
        actions.insert(0, act(Kind.KILL_WORKERS, pids=snap.workers))
    return mem, actions, f"{note}: no re-form report {waited:.1f} s after the loss; killing the workers"


def _shrink_outcome(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """After a SHRINK: the record is agreed (wait for the workers), or the restart path."""
    out = snap.shrink
    if out is not None and out.status == "ok":
        # The executor wrote the file: handed, even if the workers already gave up on it
        # in this same cycle (else the backstop would hand it to their successors).
        mem = replace(mem, generation_handed=out.record.id)
    if out is None or mem.in_place is None:
        return mem, [], ""
    if out.status == "ok":
        mem = replace(mem, in_place=replace(mem.in_place, agreed=True))
        verb = "agreed" if out.wrote else "adopted"
        return mem, [], (f"generation {out.record.id} {verb} without {', '.join(out.lost)}; "
                         f"the workers re-form in place ({out.record.world_size} workers)")
    if out.status == "unneeded":
        return replace(mem, in_place=None), [], ""
    if out.status == "fenced":
        return _fenced_out(snap, mem, out.record)
    # failed: _eviction_outcome (same snapshot) plans the kill as the restart mode does.
    return _in_place_fallback(snap, mem, out.reason or "no in-place generation")


def _fenced_out(snap: Snapshot, mem: Memory, record: GenerationRecord) -> tuple[Memory, list[Action], str]:
    """The agreed generation leaves this node out: our workers leave and rejoin as a new round."""
    mem = replace(mem, generation_handed=record.id)
    mem, actions, _ = _in_place_fallback(snap, mem, "fenced-out")
    if snap.workers:
        actions.insert(0, act(Kind.KILL_WORKERS, pids=snap.workers))
    return mem, actions, (f"generation {record.id} was agreed without this node; killing our "
                          "workers so that they rejoin as a new round")


def _handed(mem: Memory, gid: GenerationId) -> bool:
    h = mem.generation_handed
    return h is not None and h.same_round(gid) and h.seq >= gid.seq


def _generation_news(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """The backstop: an agreed record newer than our workers' generation, of their round,
    not yet handed to them (another daemon agreed it first, or our SHRINK failed)."""
    rec, gen = snap.generation_record, snap.generation
    if (rec is None or gen is None or policy.recovery_mode != IN_PLACE or not snap.workers
            or mem.phase is not Phase.RUNNING or not rec.id.newer_than(gen) or _handed(mem, rec.id)):
        return mem, [], ""
    if mem.in_place is None:
        mem = replace(mem, in_place=InPlace(rec.lost, snap.now, gen, rec.cause or "peer-lost"),
                      membership_changed_at=snap.now)
    if rec.member(snap.node_id) is None:
        return _fenced_out(snap, mem, rec)
    mem = replace(mem, generation_handed=rec.id, in_place=replace(mem.in_place, agreed=True))
    return mem, [act(Kind.WRITE_GENERATION, record=rec)], \
        f"generation {rec.id} was agreed without {', '.join(rec.lost) or '-'}; handing it to our workers"


def _publish_world(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Our record says what our workers report of their world (the others' base for a shrink)."""
    if snap.world is None or snap.world == mem.published_world:
        return mem, [], ""
    return replace(mem, published_world=snap.world), \
        [act(Kind.PUBLISH, fields={"world": snap.world.to_record()})], ""


def _checkpoint(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Publish a newly committed checkpoint; the rank-0 node also journals it (once per job)."""
    step = snap.checkpoint_step
    if step is None or step == mem.published_checkpoint:
        return mem, [], ""
    actions = [act(Kind.PUBLISH_CHECKPOINT, step=step)]
    if snap.rank0_here:
        actions.append(act(Kind.JOURNAL, event="checkpoint-committed", fields={"checkpoint": step}))
    return replace(mem, published_checkpoint=step), actions, ""


def _journal_progress(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """The rank-0 node journals where training stands every ``progress_every_s``: the
    points of a job's timeline between events (one writer per job, not one per node)."""
    if (not snap.rank0_here or snap.step is None or mem.phase is not Phase.RUNNING
            or snap.now - mem.journaled_at < policy.progress_every_s):
        return mem, [], ""
    return replace(mem, journaled_at=snap.now), [act(Kind.JOURNAL, event="progress", fields={})], ""


def _signals(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """A drain request is remembered once; its deadline is set when the drain starts."""
    if snap.stop_signals >= 2 and not mem.hard_stop:
        mem = replace(mem, hard_stop=True)
    if snap.drain_request is not None and mem.drain_reason is None:
        mem = replace(mem, drain_reason=snap.drain_request)
    return mem, [], ""


# _in_place runs before _progress (a re-form is not also a generic ``recovered``) and
# before _worker_restarts (an exit during a re-form makes the restart a membership one);
# _shrink_outcome before _eviction_outcome (a failed SHRINK plans the restart's kill).
_BOOKKEEPING: tuple[Step, ...] = (_signals, _in_place, _progress, _worker_restarts, _peer_news,
                                  _suspicions,
                                  _shrink_outcome, _eviction_outcome, _kill_due,
                                  _generation_news, _publish_world, _checkpoint, _journal_progress)


# -- phase rules (first match wins) ----------------------------------------------------


def _hard_stop(snap: Snapshot, mem: Memory, policy: Policy):
    if not mem.hard_stop:
        return None
    return (change_phase(mem, Phase.STOPPED), [act(Kind.KILL_AGENT)],
            "a second stop signal arrived; stopping now without a checkpoint")


def drain_grace(now: float, policy: Policy, notice_deadline: float | None) -> float:
    """The drain's grace: ``drain_grace_s``, cut to the notice's deadline minus a margin."""
    grace = policy.drain_grace_s
    if notice_deadline is not None:
        grace = min(grace, max(notice_deadline - now - policy.notice_margin_s, 1.0))
    return grace


def _drain(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase is Phase.DRAINING:
        return _draining(snap, mem, policy)
    if mem.drain_reason is None:
        return None
    grace = drain_grace(snap.now, policy, snap.notice_deadline)
    mem = change_phase(mem, Phase.DRAINING, drain_deadline=snap.now + grace)
    actions = [act(Kind.PUBLISH, fields={"state": "leaving"}),
               act(Kind.JOURNAL, event="node-draining", fields={"reason": mem.drain_reason,
                                                                 "grace_s": round(grace, 1)}),
               act(Kind.NOTIFY, what="stopping"), act(Kind.TOUCH_STOP_FILE)]
    if _agent_running(snap):
        actions.append(act(Kind.TERMINATE_AGENT))
    return mem, actions, f"draining because {mem.drain_reason} (grace {grace:.0f} s)"


def _draining(snap: Snapshot, mem: Memory, policy: Policy):
    actions: list[Action] = []
    if _agent_running(snap):
        if not snap.workers and not mem.left_rdzv:
            # Our workers are gone: leave the rendezvous now, not after the agent's own
            # shutdown (waiting for it cost the others 1-2 s).
            return replace(mem, left_rdzv=True), [act(Kind.LEAVE_RENDEZVOUS)], \
                "our workers stopped; leaving the rendezvous"
        if mem.drain_deadline is not None and snap.now >= mem.drain_deadline:
            return replace(mem, drain_deadline=None), [act(Kind.KILL_AGENT)], \
                "the drain grace is over; killing the agent"
        return _left_out_while_draining(snap, mem)

    if not mem.left_rdzv:
        actions.append(act(Kind.LEAVE_RENDEZVOUS))
    actions += [act(Kind.JOURNAL, event="node-left", fields={"step": snap.step}),
                act(Kind.DELETE_DRAIN_KEY)]
    return (change_phase(mem, Phase.STOPPED, left_rdzv=True), actions,
            "the agent stopped; leaving the job and exiting")


def _left_out_while_draining(snap: Snapshot, mem: Memory):
    """The others agreed a generation without this draining node (a peer was lost during
    the drain: see ``_plan_shrink``): our workers' coordinated stop cannot finish in the
    old world, and the others go on in place without us; kill them now instead of at the
    drain grace's end (nothing of theirs is needed: the others hold the live state)."""
    rec, gen = snap.generation_record, snap.generation
    if (not snap.workers or rec is None or gen is None or not rec.id.newer_than(gen)
            or rec.member(snap.node_id) is not None or _handed(mem, rec.id)):
        return None
    return (replace(mem, generation_handed=rec.id), [act(Kind.KILL_WORKERS, pids=snap.workers)],
            f"generation {rec.id} was agreed without this draining node; killing our workers "
            "(the others go on in place)")


def _agent_running(snap: Snapshot) -> bool:
    return snap.agent_pid is not None and snap.agent_exit is None


def _agent_exited(snap: Snapshot, mem: Memory, policy: Policy):
    if snap.agent_exit is None or mem.exit_handled:
        return None
    mem = replace(mem, exit_handled=True, workers=frozenset(), kill_at=None)
    if mem.isolated_since is not None or mem.agent_released:
        # Killed by us (measured: torchrun killed that way can exit 0, which read as the
        # job's completion and stopped the healthy nodes). The fault is the cut, or the
        # member gone from our agent's round: charged to no one's crash budget.
        why = ("this node is cut off from the majority" if mem.isolated_since is not None
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
    failures = _recent(mem.failures, snap.now, policy)
    count = len(failures) + 1
    if count >= policy.crash_loop_failures:
        return _mark_failed(mem, f"the agent failed {count} times without progress within "
                                 f"{policy.crash_loop_window_s:.0f} s (last exit code "
                                 f"{snap.agent_exit}); marking this node failed", snap.worker_error)
    delay = min(policy.backoff_initial_s * 2 ** (count - 1), policy.backoff_max_s)
    mem = change_phase(_count_failure(_recovering(mem, "agent-crash", snap.now), failures,
                                      snap.now), Phase.BACKOFF, restart_at=snap.now + delay)
    return (mem, [act(Kind.PUBLISH, fields={"state": "backoff", "agent_pid": None}),
                  act(Kind.JOURNAL, event="agent-failed", fields={"exit_code": snap.agent_exit})],
            f"the agent exited with code {snap.agent_exit} (failure {count} of "
            f"{policy.crash_loop_failures}); restarting it in {delay:.1f} s")


def _isolated(snap: Snapshot, mem: Memory, policy: Policy):
    """Cut off from the majority: stop our workers (the majority goes on without this
    node, and must not find it in its next round) and start nothing until it is back."""
    if mem.isolated_since is None or mem.phase not in (Phase.RUNNING, Phase.BACKOFF):
        return None
    if _agent_running(snap):
        return mem, [act(Kind.KILL_AGENT)], \
            "stopping this node's workers until it reaches the majority of the members again"
    return mem, [], ""


def _count_failure(mem: Memory, failures: tuple[float, ...], now: float) -> Memory:
    """One more failure; only a step past today's highest clears the count again."""
    return replace(mem, failures=(*failures, now), failed_at_mark=mem.high_water)


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


def _job_completed(snap: Snapshot, mem: Memory, policy: Policy):
    if snap.job_state != "completed":
        return None
    seen = mem.completed_seen_at if mem.completed_seen_at is not None else snap.now
    mem = replace(mem, completed_seen_at=seen)
    if not _agent_running(snap):
        return change_phase(mem, Phase.COMPLETED), [], "the job completed; nothing left to run"
    waited = snap.now - seen
    if waited >= policy.completion_grace_s:
        return (change_phase(mem, Phase.COMPLETED), [act(Kind.KILL_AGENT)],
                f"the job completed {waited:.0f} s ago but the agent still runs; stopping it")
    return mem, [], ""


def _reopen(snap: Snapshot, mem: Memory, policy: Policy):
    """torch closes the rendezvous when an agent gives up; an unfinished job must go on.

    An agent also closes it on success (its handler's shutdown): once our own workers
    report the job completed, a closed rendezvous is the end, not a fault (reopening it
    there warned on every normal completion, the daemons' /state not yet written)."""
    if (not snap.rdzv_closed or snap.job_state == "completed" or snap.progress_event == "completed"
            or snap.now < mem.reopen_at):
        return None
    return (replace(mem, reopen_at=snap.now + 1.0), [act(Kind.REOPEN_RENDEZVOUS)],
            "the rendezvous is closed but the job is not done; reopening it")


def _dead_peers(snap: Snapshot, mem: Memory, policy: Policy):
    if not mem.dead or snap.now < mem.evict_at:
        return None
    names = ", ".join(sorted(mem.dead))
    first = sorted(n for n, d in mem.dead.items() if d.attempts == 0)
    tried = {n: replace(d, attempts=d.attempts + 1) for n, d in mem.dead.items()}
    mem = replace(mem, evicting={**mem.evicting, **tried}, dead={}, membership_changed_at=snap.now)
    if first:
        mem = _recovering(mem, f"peer-{tried[first[0]].how}", snap.now)
    actions = [act(Kind.EVICT, peers=tuple(d.peer for d in tried.values()))]
    if records_loss(snap, mem, tried):
        actions += [act(Kind.JOURNAL, event="peer-lost", fields={"peer": n, "how": tried[n].how})
                    for n in first]
    actions += [act(Kind.COUNT, metric="evictions", label=tried[n].how) for n in first]
    if not first:
        return mem, actions, f"retrying the eviction of peer(s) {names}"
    tail = " and restarting the local workers" if mem.phase is Phase.RUNNING else ""
    if policy.recovery_mode == IN_PLACE and mem.phase is Phase.RUNNING and snap.workers:
        mem, more, tail = _plan_shrink(snap, mem, [tried[n] for n in first])
        actions += more
    return mem, actions, f"peer(s) {names} lost; evicting them from the rendezvous{tail}"


def _trained_in_round(snap: Snapshot, mem: Memory) -> bool:
    """Whether our workers have stepped in the rendezvous' newest round (a loss there is
    the in-place re-form's or the kill's, not a round still forming). Workers that have
    reported nothing at all (a joiner's first round, before its first step) trained in no
    round: goodput seed 11 stalled 40 s for good when a joiner's agent sat in a round whose
    other new member was killed, taken as "a script that reports no generation"."""
    if snap.generation is None:
        # Progress without a generation: a script that reports none; its rounds are not
        # ours to judge. No progress yet: these workers never stepped anywhere.
        return snap.step is not None
    return snap.round is None or snap.generation.round >= snap.round


def gone_members(snap: Snapshot, mem: Memory) -> frozenset[tuple[str, int]]:
    """The agents of the newest round that no live member's record names: their node is
    gone (its record expired or left), has a new agent, or the majority condemned the
    agent (a condemned node's new agent is live: the verdict was on the old one)."""
    live = {p.agent for n, p in snap.peers.items() if p.agent and p.state not in GONE_STATES
            and (n not in mem.condemned or mem.condemned[n] != p.agent)}
    mine = (snap.agent_addr, snap.agent_pid)
    return frozenset(a for a in snap.round_members if a != mine and a not in live)


def _broken_round(snap: Snapshot, mem: Memory, policy: Policy):
    """Our agent forms a round (rank assignment, its workers' group init and resume) with
    a member that is gone: torchrun waits for it until the store's timeout (issue 29: a
    node frozen between a round's close and its rank assignment stalled the job for
    good; a joiner that left did the same). Kill our agent once the grace is over (not at
    once for a member known gone, tried in 704bf82: the scale harness's survivors then lost
    agents that were already forming the next round): it starts again at once, no failure
    counted, and joins the next round without it."""
    if (not policy.release_broken_rounds or mem.phase is not Phase.RUNNING
            or not _agent_running(snap) or _trained_in_round(snap, mem)):
        return None
    mine = (snap.agent_addr, snap.agent_pid)
    gone = gone_members(snap, mem) if mine in snap.round_members else frozenset()
    if not gone:  # (a round without our agent is not one it waits in)
        return None if mem.round_broken_since is None else (
            replace(mem, round_broken_since=None), [], "")
    since = mem.round_broken_since if mem.round_broken_since is not None else snap.now
    if snap.now - since < policy.broken_round_grace_s:
        return replace(mem, round_broken_since=since), [], ""
    names = ", ".join(f"{addr}:{pid}" for addr, pid in sorted(gone))
    mem = replace(mem, round_broken_since=None, agent_released=True,
                  membership_changed_at=snap.now)
    return (mem, [act(Kind.KILL_AGENT), act(Kind.LEAVE_RENDEZVOUS),
                  act(Kind.COUNT, metric="worker_restarts", label="membership")],
            f"round {snap.round} names agent(s) {names} that are gone; restarting our agent so "
            "that the next round forms without them")


def _plan_shrink(snap: Snapshot, mem: Memory, deaths: list[Death]) -> tuple[Memory, list[Action], str]:
    """In-place mode: agree the next generation instead of killing our workers (a loss
    during a re-form widens it: the lost nodes accumulate, the start time stays)."""
    if snap.generation is None:
        # Workers that report no generation (plain torchrun scripts) cannot re-form.
        lost = tuple(sorted(d.peer.node_id for d in deaths))
        mem = replace(mem, in_place=InPlace(lost, snap.now, GenerationId(0), ""))
        mem, actions, _ = _in_place_fallback(snap, mem, "the workers report no generation")
        return mem, actions, " and restarting the local workers (they report no generation)"
    if mem.step_at is None and mem.in_place is None:
        # Our workers have not stepped since they were (re)started: the generation their
        # progress names is the previous group's, which no longer exists to re-form (seen by
        # the chaos suite: a drain's coordinated stop restarted them in the cycle the leaver
        # was found gone, and the re-form's timer then killed the new group mid-start: 6
        # steps lost). The restart under way forms its round without the lost peer.
        return mem, [], " and restarting the local workers (they have not stepped since they started)"
    fault = loss.loss_cause(d.how for d in deaths)
    ip = mem.in_place or InPlace((), snap.now, snap.generation, fault)
    # A peer that drains is left out too: its coordinated stop needs the whole old world
    # (a lost member holds it until its drain grace, 30 s), and it re-forms with no one
    # (seen in the goodput benchmark, seed 7: a freeze, a drain 2.3 s later, the re-form
    # waited for the drainer, fell back to a restart that waited 30 s for its agent).
    ip = replace(ip, lost=tuple(sorted({*ip.lost, *(d.peer.node_id for d in deaths),
                                        *leaving_peers(snap)})), agreed=False)
    return replace(mem, in_place=ip), \
        [act(Kind.SHRINK, lost=ip.lost, cause=ip.fault, peers=tuple(d.peer for d in deaths),
             generation=ip.base)], " and re-forming the world in place"


def leaving_peers(snap: Snapshot) -> tuple[str, ...]:
    """The peers whose record says they drain (their daemon published ``leaving``)."""
    return tuple(sorted(n for n, p in snap.peers.items() if p.state == "leaving"))


def hang_bound(policy: Policy, intervals: tuple[float, ...]) -> float:
    """Seconds without a step that count as a hang."""
    if policy.hang_timeout_s > 0:
        return policy.hang_timeout_s
    if not intervals:
        return policy.hang_floor_s
    return max(policy.hang_floor_s, policy.hang_factor * statistics.median(intervals))


def _diverged(snap: Snapshot, mem: Memory, policy: Policy):
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


def _unfit(snap: Snapshot, mem: Memory, policy: Policy):
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


def peers_unreachable(mem: Memory) -> bool:
    """Whether a peer is suspected, dead, being evicted or condemned, or this node is cut
    off from the majority: a stall now may be that peer's, not ours."""
    return bool(mem.dead or mem.evicting or mem.suspects or mem.suspicions or mem.condemned
                or mem.isolated_since is not None)


def _start_hang(snap: Snapshot, mem: Memory, policy: Policy):
    """Workers that never made their first step within ``start_timeout_s`` of starting
    (group init, the resume's collectives, a checkpoint load stuck on storage): before, a
    hang there ended only at gloo's 120 s or never (NCCL), since the hang timer arms at
    the first step. Killed; the restart is this node's crash unless a peer was
    unreachable (``_worker_restarts``)."""
    if mem.workers_at is None or snap.now - mem.workers_at < policy.start_timeout_s:
        return None
    waited = snap.now - mem.workers_at
    mem = _recovering(replace(mem, workers_at=None), "hang", snap.now)
    reason = (f"the workers made no first step {waited:.0f} s after they started (bound "
              f"{policy.start_timeout_s:.0f} s: group init, the resume, a checkpoint load); "
              "killing them")
    return mem, [act(Kind.KILL_WORKERS, pids=snap.workers),
                 act(Kind.JOURNAL, event="start-hang", fields={"waited_s": round(waited, 1),
                                                               "step": snap.step})], reason


def _hang(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase is not Phase.RUNNING or not snap.workers:
        return None
    if mem.step_at is None:
        return _start_hang(snap, mem, policy)
    if mem.dead or mem.evicting or mem.suspects or mem.kill_at is not None or mem.in_place:
        return None  # a peer loss explains the stall
    stalled = snap.now - mem.step_at
    bound = hang_bound(policy, mem.intervals)
    if stalled < bound:
        return None
    # No failure is counted here: the agent's restart of the killed workers is one.
    mem = _recovering(replace(mem, step_at=None), "hang", snap.now)
    reason = (f"training hung: no step for {stalled:.0f} s (bound {bound:.0f} s) while the "
              "workers are alive; killing them to recover as from a crash")
    return mem, [act(Kind.KILL_WORKERS, pids=snap.workers),
                 act(Kind.JOURNAL, event="training-hang", fields={"stalled_s": round(stalled, 1),
                                                                  "step": snap.step})], reason


def _worker_crash_loop(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase is not Phase.RUNNING or not _agent_running(snap):
        return None
    recent = _recent(mem.failures, snap.now, policy)
    if len(recent) < policy.crash_loop_failures:
        return None
    return _mark_failed(mem, f"the workers crashed {len(recent)} times without progress within "
                             f"{policy.crash_loop_window_s:.0f} s; marking this node failed",
                        snap.worker_error)


def _start(snap: Snapshot, mem: Memory, policy: Policy):
    if mem.phase not in (Phase.IDLE, Phase.BACKOFF) or _agent_running(snap):
        return None
    if snap.now < mem.restart_at:
        return None
    verb = "restarting" if mem.phase is Phase.BACKOFF else "starting"
    actions = [act(Kind.START_AGENT)]
    if not mem.ready_sent:
        actions.append(act(Kind.NOTIFY, what="ready"))
    mem = change_phase(mem, Phase.RUNNING, exit_handled=False, agent_released=False,
                  round_broken_since=None, workers=frozenset(), step_at=None, workers_at=None,
                  ready_sent=True, reformed_without=frozenset())
    return mem, actions, f"{verb} the torchrun agent"


_RULES: tuple[Rule, ...] = (_hard_stop, _drain, _agent_exited, _job_completed, _reopen, _diverged,
                            _unfit, _isolated, _dead_peers, _broken_round, _hang, _worker_crash_loop,
                            _start)
