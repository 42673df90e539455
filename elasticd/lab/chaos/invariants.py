"""The invariants checked after every scenario, each a named pass/fail with its detail.

All of them read what the run left behind (``RunResult``: the workers' progress records,
the checkpoint directory, the exit codes, the processes still alive) and nothing else,
so each can also be fed a tampered history to show it fails (tests/chaos/test_bite.py).

* ``faults-recovered``  every planned fault fired and the job was back to a world of N;
* ``job-completed``     every daemon exited 0 by itself (the job reached its last step);
* ``steps-contiguous``  the rank-0 lineage holds every step 1..final exactly once;
* ``replay-oracle``     the final checkpoint's parameters equal a single-process replay of
                        the logged (world size, LR) per step, float64, within 1e-9 of each
                        tensor's norm, and every logged step loss is the replay's (the
                        first step that is not names the fault before it);
* ``samples-exactly-once``  the sampler state the run saved (epoch, cursor) is the
                        replay's: with the oracle's match, every sample once per epoch;
* ``checkpoints-intact`` every committed checkpoint left verifies (its digests), but those the
                        run damaged on purpose, and the newest is the final step;
* ``no-corrupt-load``   no resume loaded a checkpoint while it was damaged;
* ``recovery-bounded``  per fault: recovery time and steps lost (0 for a drain, a
                        preemption notice, an etcd fault and a full checkpoint disk, at
                        most two checkpoint intervals otherwise); a preempted node drained
                        cleanly within its deadline;
* ``etcd-outage-bounded`` per etcd fault: no daemon's etcd failed it (a failed call, an
                        outage it logged) later than ETCD_BACK_S after the heal, or, after
                        a leader kill, LEADER_CHANGE_S after the kill;
* ``no-stale-commit``   no checkpoint started (so none committed) by a generation after a
                        newer generation of the same rendezvous lifetime had already
                        reached that step: a node cut off must not commit in the world it
                        was cut from. Ghost steps (a cut-off worker completing one more
                        collective from messages its peers sent before they re-formed
                        without it) are reported, not failed: the fence refuses their
                        commits and the daemon kills those workers;
* ``liveness-bounded``  whenever at least N-1 nodes (the harness' ``min_nodes``) had been
                        in the job, not hit by a fault, for longer than the lease TTL plus
                        the restart bound, the job stepped (``elasticd.lab.chaos.liveness``);
                        the longest pause is reported with the faults before it;
* ``no-process-left``   nothing the run started, process or network namespace, is alive
                        once its cluster stopped.

A failed check names the fault it is attributed to where one can be (the seed that
replays the scenario is in the report's header).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from checkpointing import CheckpointManager, layout
from checkpointing.errors import CorruptCheckpointError
from checkpointing.reader import load_verified
from checkpointing.storage import LocalStorage
from elasticd.lab.chaos import liveness
from elasticd.lab.chaos.faults import committed
from elasticd.lab.chaos.oracle import lineage, max_rel_diff, norm_rel_diff, replay_run
from elasticd.lab.chaos.run import LEASE_TTL_S
from elasticd.lab.local_cluster import record_time

if TYPE_CHECKING:
    from elasticd.lab.chaos.run import FaultRecord, RunResult

TOLERANCE = 1e-9
# The logged loss is the step's global mean (an all-reduce of per-rank sums): its rounding
# differs from the replay's one-process mean by ~1e-11 relative in a long run (measured);
# a wrong batch or LR moves it by far more from that step on.
LOSS_TOLERANCE = 1e-8
STALL_S = 1.0   # a gap between two steps longer than this is an interruption (steps: ~0.07 s)
# A shorter pause is a fault's recovery too when it begins right at the fault: an in-place
# re-form stops the survivors for ~0.3 s, which a 1 s threshold read as "never stopped"
# (the report said "0.0 s"). Short means longer than PAUSE_FACTOR x the median step
# interval before the fault and at least PAUSE_FLOOR_S, beginning within PAUSE_ONSET_S of
# the fault: a checkpoint's stall or a loaded machine's slow step seconds later is not it.
PAUSE_FACTOR = 3.0
PAUSE_FLOOR_S = 0.2
PAUSE_ONSET_S = 1.0
# A fault stops the steps while it lasts or soon after its heal (a lease expiring, a hang
# detected, a restart: the liveness bound with the harness' 5 s lease), or not at all.
ONSET_S = 20.0
# Faults that must cost no step: a drain checkpoints at an agreed step, the workers never
# wait on etcd, and a full checkpoint disk only skips periodic saves.
ZERO_LOSS = frozenset({"drain", "preemption-notice", "etcd-restart", "etcd-leader-kill",
                       "etcd-quorum-loss", "checkpoint-dir-full"})
ETCD_FAULTS = frozenset({"etcd-restart", "etcd-leader-kill", "etcd-quorum-loss"})
# How a daemon's log shows etcd failing it: its membership view or lease keeper lost etcd
# ("etcd unreachable; membership frozen ...", "...; lease keep-alive retrying") until the
# matching "etcd reachable again; ...", or one call of its loop failed.
ETCD_DOWN = "etcd unreachable"
ETCD_UP = "etcd reachable again"
ETCD_FAILED = "etcd call failed"
ETCD_BACK_S = 15.0      # heal -> no daemon's etcd call fails any more
LEADER_CHANGE_S = 5.0   # a leader kill: the two left elect in ~1 s; the client fails over


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    fault: str | None = None    # "#<index> <kind>" the failure is attributed to

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FaultMetrics:
    """One fault's cost, from the rank-0 lineage's progress records."""

    index: int
    kind: str
    recovery_s: float | None     # fault -> first step after its pause (0: none; recovery_s())
    back_to_full_s: float | None  # fault -> every node stepping in a world of N again
    steps_lost: int | None       # steps done before a restart that it redid
    etcd_outage_s: float | None = None  # fault -> the last daemon-side etcd failure (0: none)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _label(f: FaultRecord) -> str:
    return f"#{f.index} {f.kind}"


def rank0_records(progress: dict[str, list[dict]]) -> list[dict]:
    """The progress records written by rank 0 (whichever node held it), in time order,
    without the ghost steps of a cut-off world (``stale_world_steps``): a frozen rank 0
    that wakes up may complete one more step in its old generation after the survivors'
    newer one completed it (from messages sent before they re-formed without it). That
    step is not the job's (no-stale-commit shows it committed nothing); taken as the
    step's record it made the replay use the old world's size for it (found on keyed
    rounds: the oracle left the loss at the ghost step 968)."""
    ghosts = {id(record) for record, _, _ in stale_world_steps(progress)}
    return sorted((r for recs in progress.values() for r in recs
                   if r.get("rank") == 0 and id(r) not in ghosts), key=lambda r: r["time"])


def _steps(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r["event"] in ("step", "checkpoint")]


def recovery_s(records: list[dict], t_fault: float, t_until: float,
               onset_by: float = float("inf")) -> float | None:
    """Fault -> the first step that ends the first pause after it, before ``t_until``.

    A pause is an interruption (a gap > STALL_S) that began by ``onset_by``, or a short
    pause (``short_pause_s``: a few step intervals, e.g. an in-place re-form's 0.3 s)
    that began within PAUSE_ONSET_S of the fault. 0.0 when the steps never paused, or
    stopped first only after ``onset_by`` (a later hiccup is not this fault's: the last
    fault of seed 41's overlap run, an etcd quorum loss training never waited on, was
    charged a 2.2 s gap 579 s later as a 581 s recovery); None if no step came."""
    steps = _steps(records)
    before = [r["time"] for r in steps if r["time"] <= t_fault]
    after = [r["time"] for r in steps if t_fault < r["time"] < t_until]
    if not after:
        return None
    short = short_pause_s(before)
    previous = before[-1] if before else t_fault
    for t in after:
        gap = t - previous
        if gap > STALL_S:
            return t - t_fault if previous <= onset_by else 0.0
        if gap > short and previous <= t_fault + PAUSE_ONSET_S:
            return t - t_fault
        previous = t
    return 0.0


def short_pause_s(times: list[float], last: int = 20) -> float:
    """The gap between two steps that is a pause, not the cadence: PAUSE_FACTOR x the
    median of the ``last`` intervals of ``times``, at least PAUSE_FLOOR_S (STALL_S with
    fewer than two steps to tell the cadence from)."""
    recent = times[-last - 1:]
    intervals = sorted(b - a for a, b in zip(recent[:-1], recent[1:], strict=True))
    if not intervals:
        return STALL_S
    return min(STALL_S, max(PAUSE_FLOOR_S, PAUSE_FACTOR * intervals[len(intervals) // 2]))


def steps_lost(records: list[dict], t_fault: float, t_until: float) -> int:
    """Steps redone after each resume in [t_fault, t_until): the last step completed before
    the resume minus the step it resumed from."""
    lost = 0
    last_step = None
    for r in records:
        if r["event"] in ("step", "checkpoint"):
            last_step = r["step"]
        elif r["event"] == "resumed" and t_fault <= r["time"] < t_until and last_step is not None:
            lost += max(0, last_step - r["step"])
    return lost


def fault_metrics(result: RunResult) -> list[FaultMetrics]:
    records = rank0_records(result.progress)
    fired = [f for f in result.faults if f.t_inject is not None]
    out = []
    for i, f in enumerate(fired):
        until = fired[i + 1].t_inject if i + 1 < len(fired) else result.t_end
        back = f.t_recovered - f.t_inject if f.t_recovered else None
        etcd_until = etcd_window_end(fired, i, result.t_end)
        ends = [etcd_trouble_until(events, f.t_inject, etcd_until)
                for events in result.daemon_events.values()]
        longest = max((end - f.t_inject for end in ends if end is not None), default=0.0)
        onset_by = (f.t_heal or f.t_inject) + ONSET_S
        out.append(FaultMetrics(f.index, f.kind, _round(recovery_s(records, f.t_inject, until, onset_by)),
                                _round(back), steps_lost(records, f.t_inject, until), _round(longest)))
    return out


def etcd_window_end(fired: list[FaultRecord], i: int, t_end: float) -> float:
    """Where the etcd trouble after fired fault ``i`` stops being its own: the next etcd
    fault's injection, or the run's end. Not the next fault of any kind: one that overlaps
    an outage (seed 43: a worker kill 2.4 s into an etcd restart, before its heal) does
    not end it, and cutting the window there read every daemon's outage as endless."""
    return next((f.t_inject for f in fired[i + 1:] if f.kind in ETCD_FAULTS), t_end)


def etcd_trouble_until(events: list[dict], start: float, until: float) -> float | None:
    """The last moment in [start, until) one daemon's log shows etcd failing it (a failed
    call, an "unreachable" line, or the "reachable again" that ended one), measured to
    ``until`` if an "unreachable" there was never followed by its "reachable again" (the
    membership view and the lease keeper each log a pair); None: no trouble at all."""
    last, open_ = None, set()
    for e in events:
        t, text = record_time(e), str(e.get("event", ""))
        if t is None or not start <= t < until:
            continue
        what = text.partition("; ")[2].split(" ")[0]   # "membership" | "lease" | ...
        if text.startswith(ETCD_DOWN):
            open_.add(what)
        elif text.startswith(ETCD_UP):
            open_.discard(what)
        elif not text.startswith(ETCD_FAILED):
            continue
        last = t
    return until if open_ else last


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def _attribute(result: RunResult, when: float | None) -> str | None:
    """The last fault injected before ``when`` (the one a failure at that time follows)."""
    if when is None:
        return None
    before = [f for f in result.faults if f.t_inject is not None and f.t_inject <= when]
    return _label(before[-1]) if before else None


# -- the checks -------------------------------------------------------------------------------

def check_faults(result: RunResult) -> Check:
    bad = [f for f in result.faults if f.error]
    if bad or len(result.faults) != len(result.scenario.faults):
        first = bad[0] if bad else None
        return Check("faults-recovered", False, "; ".join(f"{_label(f)}: {f.error}" for f in bad)
                     or "not every fault was run", _label(first) if first else None)
    return Check("faults-recovered", True, f"{len(result.faults)} faults fired, each recovered "
                 f"to a world of {result.scenario.nodes}")


def check_completed(result: RunResult) -> Check:
    ok = result.error is None and all(c == 0 for c in result.exit_codes.values())
    detail = f"exit codes {result.exit_codes}" + (f"; {result.error}" if result.error else "")
    return Check("job-completed", ok, detail)


def check_contiguous(result: RunResult, history: dict[int, dict]) -> Check:
    final = result.scenario.final_step
    missing = [s for s in range(1, final + 1) if s not in history]
    extra = sorted(s for s in history if not 1 <= s <= final)
    if missing or extra:
        # The time of the step before the first gap: the fault that cost it came before.
        before = history.get(missing[0] - 1) if missing else None
        return Check("steps-contiguous", False,
                     f"{len(missing)} step(s) missing (first {missing[:5]}), beyond the end {extra[:5]}",
                     _attribute(result, before["time"] if before else None))
    return Check("steps-contiguous", True, f"steps 1..{final}, each once in the rank-0 lineage")


def _final_state(result: RunResult) -> tuple[int, dict] | str:
    try:
        loaded = CheckpointManager(result.ckpt_dir, read_only=True).load_latest()
    except Exception as exc:  # noqa: BLE001 - an unreadable directory is the finding
        return f"checkpoints unreadable: {exc}"
    if loaded is None:
        return "no checkpoint verifies"
    return loaded.step, loaded.state


def check_oracle(result: RunResult, history: dict[int, dict]) -> list[Check]:
    """``replay-oracle`` and ``samples-exactly-once`` (both need the replay)."""
    final = _final_state(result)
    if isinstance(final, str):
        return [Check("replay-oracle", False, final), Check("samples-exactly-once", False, final)]
    step, state = final
    try:
        hist = {s: (history[s]["world_size"], history[s]["lr"]) for s in range(1, step + 1)}
    except KeyError as exc:
        why = f"step {exc} is missing from the lineage: nothing to replay"
        return [Check("replay-oracle", False, why), Check("samples-exactly-once", False, why)]
    replayed = replay_run(result.run, hist)
    rel = norm_rel_diff(state["model"], replayed.params)
    elem = max_rel_diff(state["model"], replayed.params)
    off = first_loss_divergence(history, replayed.losses)
    ok = rel < TOLERANCE and off is None
    where = "" if off is None else f"; the logged loss leaves the replay's at step {off}"
    blame = None if ok else (_attribute(result, history[off]["time"]) if off is not None
                             else _first_divergence(result, history))
    oracle = Check("replay-oracle", ok, f"relative difference {rel:.3e} (tensor norms; worst element "
                   f"{elem:.1e}) over {step} steps, tolerance {TOLERANCE:g}{where}", blame)
    saved = state.get("sampler", {})
    got = (saved.get("epoch"), saved.get("cursor"))
    want = (replayed.epoch, replayed.cursor)
    once = Check("samples-exactly-once", got == want and ok,
                 f"saved sampler (epoch, cursor) {got}, replay {want}"
                 + ("" if ok else "; the oracle failed: the data order is not shown"))
    return [oracle, once]


def first_loss_divergence(history: dict[int, dict], losses: dict[int, float]) -> int | None:
    """The first step whose logged loss (``loss`` of the record naming it in ``loss_step``)
    is not the replay's within LOSS_TOLERANCE; None if every logged one is."""
    logged = {r["loss_step"]: r["loss"] for r in history.values()
              if r.get("loss_step") is not None and r.get("loss") is not None}
    for step in sorted(logged):
        want = losses.get(step)
        if want is not None and abs(logged[step] - want) > LOSS_TOLERANCE * max(abs(want), 1e-300):
            return step
    return None


def _first_divergence(result: RunResult, history: dict[int, dict]) -> str | None:
    """The fault before the oldest retained checkpoint that no longer matches the replay."""
    storage = LocalStorage(result.ckpt_dir)
    for step, _ in sorted(committed(result.ckpt_dir)):
        if any(s not in history for s in range(1, step + 1)):
            continue
        try:
            loaded = load_verified(storage, layout.step_dir(step), step, "cpu")
        except CorruptCheckpointError:
            continue
        hist = {s: (history[s]["world_size"], history[s]["lr"]) for s in range(1, step + 1)}
        if norm_rel_diff(loaded.state["model"], replay_run(result.run, hist).params) >= TOLERANCE:
            return _attribute(result, history[step]["time"])
    return None


def check_checkpoints(result: RunResult) -> Check:
    storage = LocalStorage(result.ckpt_dir)
    steps = sorted(step for step, _ in committed(result.ckpt_dir))
    bad, exempt = [], []
    for step in steps:
        try:
            load_verified(storage, layout.step_dir(step), step, "cpu")
        except CorruptCheckpointError as exc:
            (exempt if exc.path in result.corrupted or any(
                exc.path.endswith(p) for p in result.corrupted) else bad).append(f"{step}: {exc.reason}")
    final = result.scenario.final_step
    ok = not bad and bool(steps) and steps[-1] == final
    detail = (f"committed {steps}; damaged by the run itself (exempt): {exempt or 'none'}; "
              f"corrupt: {bad or 'none'}; newest {'is' if steps and steps[-1] == final else 'is not'} "
              f"the final step {final}")
    return Check("checkpoints-intact", ok, detail)


def corrupt_loads(result: RunResult) -> list[str]:
    """Each resume that loaded a step while the run had it damaged: after the damage and
    before that step was committed again."""
    damaged = [(f.detail["step"], f.t_inject, f) for f in result.faults
               if f.kind == "checkpoint-corrupt" and f.t_inject is not None and "step" in f.detail]
    every = sorted((r for recs in result.progress.values() for r in recs), key=lambda r: r["time"])
    found = []
    for step, t_damaged, fault in damaged:
        recommitted = min((r["time"] for r in every if r["event"] == "checkpoint"
                           and r["step"] == step and r["time"] > t_damaged), default=float("inf"))
        found += [f"{_label(fault)}: rank {r['rank']} resumed from damaged step {step}"
                  for r in every if r["event"] == "resumed" and r["step"] == step
                  and t_damaged < r["time"] < recommitted]
    return found


def check_corrupt_loads(result: RunResult) -> Check:
    found = corrupt_loads(result)
    damaged = sorted(set(result.corrupted.values()))
    if found:
        return Check("no-corrupt-load", False, "; ".join(found), found[0].split(":")[0])
    return Check("no-corrupt-load", True, f"damaged steps {damaged or 'none'}; no resume loaded one")


def loss_limits(result: RunResult) -> dict[int, int]:
    """The steps each fired fault may cost: none for ZERO_LOSS kinds, else two checkpoint
    intervals. A fault fired inside the recovery of the one before it (an ``overlap`` in
    its detail: the same burst) inherits the largest limit of its burst so far, because
    steps_lost charges a rollback to the window it lands in (seed 43: a worker killed on a
    corrupted checkpoint redid 20 steps 0.4 s later, in the window of an etcd-leader-kill
    that overlapped it)."""
    bound = 2 * result.scenario.every_steps
    limits: dict[int, int] = {}
    burst = 0
    for f in (f for f in result.faults if f.t_inject is not None):
        own = 0 if f.kind in ZERO_LOSS else bound
        burst = max(burst, own) if "overlap" in f.detail else own
        limits[f.index] = burst
    return limits


def check_recovery(result: RunResult, metrics: list[FaultMetrics]) -> Check:
    limits = loss_limits(result)
    details = {f.index: f.detail for f in result.faults}
    bad = []
    for m in metrics:
        limit = limits[m.index]
        if m.back_to_full_s is None or m.steps_lost is None or m.steps_lost > limit:
            bad.append((m, f"#{m.index} {m.kind}: back to full {m.back_to_full_s} s, "
                           f"{m.steps_lost} steps lost (at most {limit})"))
        detail = details.get(m.index, {})
        if m.kind == "preemption-notice" and (detail.get("drained_s") is None
                                              or detail.get("drain_exit_code") != 0):
            bad.append((m, f"#{m.index} {m.kind}: not drained cleanly within its "
                           f"{detail.get('deadline_s')} s deadline (exit {detail.get('drain_exit_code')})"))
    rows = ", ".join(f"#{m.index} {m.kind} {m.recovery_s} s/{m.steps_lost} lost" for m in metrics)
    if bad:
        return Check("recovery-bounded", False, "; ".join(b for _, b in bad),
                     f"#{bad[0][0].index} {bad[0][0].kind}")
    return Check("recovery-bounded", True, rows or "no fault fired")


def _generation(record: dict) -> tuple[str, int, int] | None:
    g = record.get("generation")
    if not isinstance(g, dict) or not all(isinstance(g.get(k), int) for k in ("round", "seq")):
        return None
    return str(g.get("epoch")), g["round"], g["seq"]


def stale_world_steps(progress: dict[str, list[dict]]) -> list[tuple[dict, str, dict]]:
    """(record, its node, the newer record it came after) for each step or checkpoint
    record of a generation that completed step s after a newer generation (same epoch)
    had completed a step <= s, where s is beyond every step the older generation had
    completed before the newer one's first. So neither a restart that redoes steps from
    a checkpoint (the old world's steps came first) nor a record a stopped worker writes
    late for a step its world had completed together is one: the old world went on."""
    every = sorted(((r, node) for node, recs in progress.items() for r in recs
                    if r.get("event") in ("step", "checkpoint") and _generation(r)),
                   key=lambda rn: rn[0]["time"])
    first: dict[tuple[str, int, int], dict] = {}      # each generation's first record
    reached: dict[tuple[str, int, int], int] = {}     # each one's highest step so far
    # (older, newer) -> the older one's highest step when the newer one's first came.
    at_start: dict[tuple[tuple[str, int, int], tuple[str, int, int]], int] = {}
    found = []
    for record, node in every:
        gen = _generation(record)
        if gen not in first:
            first[gen] = record
            at_start |= {(g, gen): step for g, step in reached.items() if g[0] == gen[0] and g[1:] < gen[1:]}
        step = record["step"]
        newer = [first[g] for g in first if g[0] == gen[0] and g[1:] > gen[1:]
                 and first[g]["step"] <= step and step > at_start.get((gen, g), -1)]
        if newer:
            found.append((record, node, min(newer, key=lambda f: f["time"])))
        reached[gen] = max(reached.get(gen, step), step)
    return found


def check_stale_commit(result: RunResult) -> Check:
    found = stale_world_steps(result.progress)
    commits = [f for f in found if f[0]["event"] == "checkpoint"]

    def say(f: tuple[dict, str, dict]) -> str:
        record, node, newer = f
        what = "checkpoint" if record["event"] == "checkpoint" else "step"
        return (f"node {node} {what} {record['step']} in generation {_gen(record)} after generation "
                f"{_gen(newer)} had completed step {newer['step']}")

    ghosts = [f for f in found if f not in commits]
    ghost = f"; {len(ghosts)} ghost step(s) of a cut-off world, first: {say(ghosts[0])}" if ghosts else ""
    if commits:
        return Check("no-stale-commit", False, f"{len(commits)} stale checkpoint(s); first: "
                     f"{say(commits[0])}{ghost}", _attribute(result, commits[0][0]["time"]))
    return Check("no-stale-commit", True, "no checkpoint started in a world older than one that "
                 f"had reached its step{ghost}")


def _gen(record: dict) -> str:
    return "{round}.{seq}".format(**record["generation"])


def check_etcd_outages(result: RunResult) -> Check:
    """Per etcd fault: no daemon's etcd failed it later than ETCD_BACK_S after the heal,
    or, after a leader kill, later than LEADER_CHANGE_S after the kill."""
    fired = [f for f in result.faults if f.t_inject is not None]
    bad, rows = [], []
    for i, f in enumerate(fired):
        if f.kind not in ETCD_FAULTS:
            continue
        until = etcd_window_end(fired, i, result.t_end)
        heal = f.t_heal or f.t_inject
        for node, events in sorted(result.daemon_events.items()):
            end = etcd_trouble_until(events, f.t_inject, until)
            if end is None:
                continue
            rows.append(f"{_label(f)} {node} {end - f.t_inject:.1f} s")
            if end >= until:
                bad.append((f, f"{_label(f)}: {node}'s etcd outage never ended"))
            elif f.kind == "etcd-leader-kill" and end - f.t_inject > LEADER_CHANGE_S:
                bad.append((f, f"{_label(f)}: {node}'s etcd failed it {end - f.t_inject:.1f} s after "
                               f"the leader's kill (a leader change: at most {LEADER_CHANGE_S:g})"))
            elif end - heal > ETCD_BACK_S:
                bad.append((f, f"{_label(f)}: {node}'s etcd failed it {end - heal:.1f} s after the "
                               f"heal (at most {ETCD_BACK_S:g})"))
    if bad:
        return Check("etcd-outage-bounded", False, "; ".join(b for _, b in bad), _label(bad[0][0]))
    kinds = sum(f.kind in ETCD_FAULTS for f in fired)
    return Check("etcd-outage-bounded", True, f"{kinds} etcd fault(s); fault -> a daemon's last etcd "
                 f"failure: {', '.join(rows) or 'none logged'}")


def check_liveness(result: RunResult, lease_ttl_s: float) -> Check:
    """``liveness-bounded``: a node hit by a fault is out from its injection to its heal;
    an etcd fault puts every node out meanwhile (none can reach the rendezvous: a restart
    needed then waits for etcd); other faults of the cluster put no node out."""
    steps = [r["time"] for recs in result.progress.values() for r in _steps(recs)]
    t0 = result.t_formed if result.t_formed is not None else result.t_start
    done = any(r["event"] == "completed" for recs in result.progress.values() for r in recs)
    t1 = max(steps) if done and steps else result.t_end  # a finished job owes no more steps
    nodes = set(result.exit_codes) | set(result.progress)
    out: dict[str, list[tuple[float, float]]] = {}
    for f in result.faults:
        hit = [f.target] if f.target else sorted(nodes) if f.kind in ETCD_FAULTS else []
        for node in hit if f.t_inject is not None else []:
            out.setdefault(node, []).append((f.t_inject, f.t_heal or result.t_end))
    bound = lease_ttl_s + liveness.RESTART_BOUND_S
    min_nodes = max(1, result.scenario.nodes - 1)
    owed = liveness.violations(steps, out, nodes, t0, t1, min_nodes, bound)
    worst = liveness.longest(liveness.pauses(steps, t0, t1))
    before = [_label(f) for f in result.faults if worst is not None and f.t_inject is not None
              and worst.start - 30 <= f.t_inject <= worst.end]
    said = "no pause" if worst is None else (
        f"longest pause {worst.length_s:.1f} s at +{worst.start - t0:.1f} s after "
        f"{', '.join(before) or 'no fault'} (bound {bound:.0f} s)")
    if owed:
        v = owed[0]
        return Check("liveness-bounded", False,
                     f"no step for {v.length_s:.1f} s from +{v.start - t0:.1f} s while "
                     f"{', '.join(v.nodes)} had been in the job for over {bound:.0f} s; {said}",
                     _attribute(result, v.start))
    return Check("liveness-bounded", True, said)


def check_processes(result: RunResult) -> Check:
    if result.leftover:
        return Check("no-process-left", False, f"alive after the cluster stopped: {result.leftover}")
    return Check("no-process-left", True, "none of the run's processes is alive")


def check_all(result: RunResult) -> tuple[list[Check], list[FaultMetrics]]:
    """Every invariant, in the report's order, and the per-fault metrics."""
    history = lineage(rank0_records(result.progress))
    metrics = fault_metrics(result)
    checks = [check_faults(result), check_completed(result), check_contiguous(result, history),
              *check_oracle(result, history), check_checkpoints(result), check_corrupt_loads(result),
              check_recovery(result, metrics), check_etcd_outages(result),
              check_stale_commit(result), check_liveness(result, LEASE_TTL_S),
              check_processes(result)]
    return checks, metrics
