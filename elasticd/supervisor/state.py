"""The policy's vocabulary: the phases and their edges, the tunables, what a cycle sees
(``Snapshot``), what the daemon remembers (``Memory``, one record per concern) and the one
function that changes the phase (``change_phase``)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from elasticd.actions import Action, Kind
from elasticd.contract.generation import Entering, GenerationId, GenerationRecord, WorldView
from elasticd.contract.progress import Reform
from elasticd.contract.settings import DEFAULT_RECOVERY, RecoveryMode
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
    # A new node enters a live in-place world without a round (supervisor.joining): the
    # [recovery] join_in_place setting, on keyed rounds in the in-place mode only.
    join_in_place: bool = False
    max_nodes: int = 1 << 30
    nproc: int = 1   # workers per node ([job] nproc_per_node, resolved)
    # A newcomer's workers that are not warm (imports, device, model) this long after its
    # agent started are given up: the agent starts again and joins an ordinary round.
    join_warm_timeout_s: float = 120.0
    # A warm newcomer waits this long at most for another newcomer that is entering the
    # same live world but not warm yet, so that both enter as one generation (the members
    # re-form once for both, not once each).
    join_batch_s: float = 5.0
    # An agent start waits this long at most (from the server's start, with the daemon)
    # for the warm-start server's imports, to be forked there (elasticd.agent): measured
    # 4.4 s on an idle machine here, 7-9 s beside a training job; past it, it starts cold.
    warm_agent_wait_s: float = 20.0


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
    entering: Entering | None = None       # its newcomers wait to enter a live world


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
    drained: ShrinkOutcome | None = None   # the last DRAIN_IN_PLACE's outcome
    grown: ShrinkOutcome | None = None     # the last GROW_IN_PLACE's outcome
    generation_record: GenerationRecord | None = None  # etcd: the agreed generation
    worker_error: str | None = None        # agent log: the workers' newest exception line
    # The warm-start server (elasticd.warmstart.WarmHost.state): off | importing | ready |
    # dead, and how long since it was started.
    warm_server: str = "off"
    warm_server_age_s: float = 0.0

    def newcomers(self, live: GenerationId, warm: bool = True) -> list[Entering]:
        """The live peers whose newcomers are (``warm``) or are not yet warm for a world of
        ``live``'s round (they accept any generation of it that names them), in node order:
        the others a join proposal takes along, the spares a loss's generation takes in."""
        return sorted((p.entering for p in self.peers.values()
                       if p.entering is not None and p.entering.warm == warm
                       and p.entering.live.same_round(live) and p.state not in GONE_STATES),
                      key=lambda e: e.node)


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
    # A planned change (a peer's drain): the workers take it after the next step the world
    # agrees, so their report may come a step or two later than a loss's.
    planned: bool = False


@dataclass(frozen=True)
class Lifecycle:
    """The node's own run: its agent and workers, their steps, the crash count, the drain."""

    failures: tuple[float, ...] = ()       # crash times since the last progress
    high_water: int = -1                   # the highest step the workers ever reported
    failed_at_mark: int = -1               # high_water when the last failure was counted
    restart_at: float = 0.0                # end of the current backoff
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
    drain_since: float | None = None       # when the drain began
    # The drain runs in place (lifecycle.drains_in_place): our workers stop after the step
    # the world agrees and the others re-form without them; False once it falls back.
    drain_in_place: bool = False
    left_rdzv: bool = False
    reopen_at: float = 0.0                 # earliest retry of a reopen
    completed_seen_at: float | None = None
    ready_sent: bool = False
    hard_stop: bool = False
    recovering: tuple[str, float] | None = None   # (what broke, since when) until the next step
    # Since when the round our agent is forming names an agent that is gone; whether we
    # killed our agent to release it from that round (its exit is then no failure).
    round_broken_since: float | None = None
    agent_released: bool = False
    # A join in place (supervisor.joining): the live world our newcomers enter, since when,
    # whether the generation with us was proposed, when it was agreed; a join that fell back
    # is not tried again until our workers step.
    joining: GenerationId | None = None
    joining_since: float | None = None
    join_proposed: bool = False
    join_agreed_at: float | None = None
    join_fell_back: bool = False
    join_warm_at: float | None = None   # when our newcomers reported warm (published then)
    warm_wait_said: bool = False   # the wait for the warm-start server was logged (once)


@dataclass(frozen=True)
class PeerMemory:
    """What this node knows of its peers: suspicions, deaths, evictions, the majority's verdicts."""

    membership_changed_at: float = float("-inf")
    peers_seen: frozenset[str] = frozenset()
    suspects: Mapping[str, tuple[PeerView, float]] = field(default_factory=dict)
    dead: Mapping[str, Death] = field(default_factory=dict)      # to evict
    evicting: Mapping[str, Death] = field(default_factory=dict)  # EVICT sent, outcome pending
    kill_at: float | None = None           # crashed peer: kill the old world's workers then ...
    kill_pids: frozenset[int] = frozenset()  # ... if these are still alive
    evict_at: float = 0.0                  # earliest retry of a failed eviction
    refused_at: Mapping[str, float] = field(default_factory=dict)  # last refused probe per peer
    # elasticd.quorum: this node's own suspicions (node -> (how, since)), published in its
    # record; when its probes of each peer first went unanswered; the peers a majority
    # condemned, with the agent their record named then (``peers._held_verdicts``: acted on
    # once); since when this node is cut off from the majority (it then stops its
    # workers and waits).
    suspicions: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    silent_since: Mapping[str, float] = field(default_factory=dict)
    published_suspects: frozenset[str] = frozenset()
    condemned: Mapping[str, tuple[str, int] | None] = field(default_factory=dict)
    isolated_since: float | None = None

    @property
    def unreachable(self) -> bool:
        """Whether a peer is suspected, dead, being evicted or condemned, or this node is cut
        off from the majority: a stall now may be that peer's, not ours."""
        return bool(self.dead or self.evicting or self.suspects or self.suspicions
                    or self.condemned or self.isolated_since is not None)


@dataclass(frozen=True)
class ReformMemory:
    """The in-place re-form: the one under way, the generations handed to our workers."""

    in_place: InPlace | None = None
    generation_handed: GenerationId | None = None  # newest record handed to our workers
    published_world: WorldView | None = None
    # Peers the current worker group already re-formed without: the EVICT's outcome can
    # come after the re-form (measured: re-formed 0.1 s after the crash), and must not kill
    # them then. It belongs to that group: a new group (a restart, a new agent) starts
    # empty, or a peer re-formed out once, back, and lost again before the new group's
    # first step would get no kill (its survivors hung until the collective timeout).
    reformed_without: frozenset[str] = frozenset()


@dataclass(frozen=True)
class JournalMemory:
    """What this node last journaled and published for the job's record."""

    journaled_at: float = float("-inf")    # last periodic progress entry
    published_checkpoint: int | None = None


# The record that owns each field (``Memory.but`` routes a change by it).
_RECORDS = {"life": Lifecycle, "peer": PeerMemory, "reform": ReformMemory, "journal": JournalMemory}
_OWNER = {f.name: record for record, cls in _RECORDS.items() for f in fields(cls)}


@dataclass(frozen=True)
class Memory:
    """The daemon's state across cycles, one record per concern; ``decide`` returns the next one.

    The phase changes only through ``change_phase`` (checked against ``PHASE_EDGES``);
    every other field through ``but``, which finds the record that owns it."""

    phase: Phase = Phase.IDLE
    life: Lifecycle = field(default_factory=Lifecycle)
    peer: PeerMemory = field(default_factory=PeerMemory)
    reform: ReformMemory = field(default_factory=ReformMemory)
    journal: JournalMemory = field(default_factory=JournalMemory)

    @classmethod
    def of(cls, phase: Phase = Phase.IDLE, **changes: Any) -> Memory:
        """A memory in ``phase`` with ``changes`` (field names of any record; tests, start-up)."""
        return cls(phase).but(**changes)

    def but(self, **changes: Any) -> Memory:
        """This memory with ``changes``, each applied to the record that owns the field."""
        by_record: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name not in _OWNER:
                raise TypeError(f"Memory has no field {name!r}" + (
                    ": the phase changes through change_phase" if name == "phase" else ""))
            by_record.setdefault(_OWNER[name], {})[name] = value
        return replace(self, **{r: replace(getattr(self, r), **f) for r, f in by_record.items()})


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


# A bookkeeping step or a phase rule: (snapshot, memory, policy) -> (memory, actions, sentence).
Step = Callable[[Snapshot, Memory, Policy], tuple[Memory, list[Action], str]]


Rule = Callable[[Snapshot, Memory, Policy], "tuple[Memory, list[Action], str] | None"]


def change_phase(mem: Memory, phase: Phase, **changes: Any) -> Memory:
    """``mem`` in ``phase`` (and ``changes``): the one way a rule changes the phase, checked
    against ``PHASE_EDGES`` (as Supervisor's ``change_state`` checks its table)."""
    if phase not in PHASE_EDGES[mem.phase]:
        raise IllegalPhaseChange(f"{mem.phase.value} -> {phase.value} is not a phase change "
                                 "the daemon makes (supervisor.PHASE_EDGES)")
    return replace(mem, phase=phase).but(**changes)


# The node-record states of a node that is no longer in the job (or leaving it): not live.
GONE_STATES = frozenset({"leaving", "completed", "failed"})


def agent_running(snap: Snapshot) -> bool:
    return snap.agent_pid is not None and snap.agent_exit is None


def begin_recovery(mem: Memory, kind: str, now: float) -> Memory:
    """Start timing a recovery (the first fault of a burst sets the start)."""
    return mem if mem.life.recovering is not None else mem.but(recovering=(kind, now))
