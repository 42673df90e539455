"""The chaos runner: a local cluster, the job, the scenario's faults at their moments, the end.

One run, in states::

    forming    N daemons started (elasticd.lab.local_cluster), waiting for a world of N
    faulting   per fault: wait for its step/time -> inject -> hold -> heal -> recovered
               (every node stepping in a world of N, without a pause, for SETTLE_S) or
               not (the run goes on to the end without the remaining faults: they are
               reported as not fired)
    finishing  every daemon exits by itself once the job reaches its final step
    stopped    the cluster is killed whole (local_cluster's exit); leftovers are counted
    checked    the invariants (elasticd.lab.chaos.invariants) read the logs and checkpoints

The job is ``trainer/examples/mlp.py`` in float64 with every step logged, so that the
replay oracle can recompute it.
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elasticd import proctree
from elasticd.lab.chaos.faults import INJECTORS, Detail, InjectionError, Injector, Target, workers_of
from elasticd.lab.chaos.oracle import Run
from elasticd.lab.chaos.scenario import PHASES, FaultSpec, Scenario
from elasticd.lab.embedded_etcd import etcd_version
from elasticd.lab.fake_metadata import FakeMetadata
from elasticd.lab.local_cluster import (
    MLP,
    Cluster,
    DaemonNode,
    _identity,
    describe,
    local_cluster,
    record_time,
    stepping_at,
)

# The job the oracle replays: small enough that a step costs ~nothing beyond its sleep.
RUN = Run(samples=300, batch=4, lr=0.05, seed=7, data_seed=11, momentum=0.9)
LEASE_TTL_S = 5
# A first world needs every agent to import torch: 70-130 s each at a load of 15-20 on
# 2 cores (measured; 180 s was too short there in 2 runs of 4).
FORM_TIMEOUT_S = 300.0
RECOVER_TIMEOUT_S = 180.0
# A fault's effect can come late: after an agent's SIGKILL its workers step on until the
# restarted agent's rendezvous restarts them all (seen: "recovered" 0.2 s after the kill,
# then the restart). Recovered means stable: every node stepped in a world of N within
# the last FRESH_S, continuously for SETTLE_S.
SETTLE_S = 6.0
FRESH_S = 1.0
# An overlapping fault whose phase never begins fires this long after the previous one's
# injection, its record marked (phase_seen false): the scenario asked for what did not come.
PHASE_TIMEOUT_S = 90.0
Say = Callable[[str], None]


def entrypoint(sc: Scenario, run: Run = RUN) -> list[str]:
    return [MLP, *run.args(), f"--max-steps={sc.final_step}", f"--step-sleep={sc.step_sleep}",
            "--log-every=1", "--lr-rule=linear", "--lr-warmup-steps=2",
            # The LR is for the full world: with the default base (1) it would be N times
            # larger and the run chaotic (rounding differences would then outgrow 1e-9).
            f"--lr-base-world-size={sc.nodes}"]


@dataclass
class FaultRecord:
    """What happened to one planned fault (times are Unix seconds)."""

    index: int
    kind: str
    planned: str
    target: str | None = None          # the node it hit (None: the cluster)
    step: int | None = None            # the job's step when it was injected
    t_inject: float | None = None
    t_heal: float | None = None
    t_recovered: float | None = None   # every node stepping in a world of N again
    detail: Detail = field(default_factory=dict)
    error: str | None = None           # could not be injected, or never recovered

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunResult:
    scenario: Scenario
    root: Path
    run: Run
    faults: list[FaultRecord]
    t_start: float
    t_formed: float | None
    t_end: float
    exit_codes: dict[str, int | None]
    progress: dict[str, list[dict]]    # node -> its progress records, in order
    corrupted: dict[str, int]          # checkpoint files damaged on purpose -> step
    leftover: list[str]                # processes still alive after the cluster stopped
    error: str | None = None
    etcd: str = ""                     # the etcd server's binary and version
    # node -> the daemon's log lines about its etcd connection (the outage check reads them)
    daemon_events: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def ckpt_dir(self) -> Path:
        return self.root / "ckpt"


def _step_now(nodes: list[DaemonNode]) -> int:
    return max(((n.progress() or {}).get("step", 0) for n in nodes if n.running()), default=0)


def _due(spec: FaultSpec, nodes: list[DaemonNode], t_formed: float) -> bool:
    if spec.at_step is not None:
        return _step_now(nodes) >= spec.at_step
    return time.time() >= t_formed + spec.at_s


def resolve_target(spec: FaultSpec, injector: Injector, t: Target, rng: random.Random,
                   busy: frozenset[str] = frozenset(), notes: Detail | None = None) -> DaemonNode | None:
    """The node a fault hits: the scenario's target unless the injector fixes its own.
    Never one of ``busy`` (hit by an earlier fault of the same burst, not yet healed: two
    heals would restart it twice): such a target gives way to another running node,
    drawn, and ``notes`` gets ``retargeted_from``."""
    if injector.target_rule == "cluster":
        return None
    rule = "rank0" if injector.target_rule == "rank0" else spec.target
    running = [n for n in t.running() if n.name not in busy]
    if rule == "rank0":
        node = t.rank0()
    elif rule == "other":
        rank0 = t.rank0()
        others = [n for n in running if n is not rank0]
        node = rng.choice(others) if others else None
    elif rule == "any":
        node = rng.choice(running) if running else None
    else:
        node = t.nodes.get(rule)
        node = node if node is not None and node.running() else None
    if node is not None and node.name in busy:
        if not running:
            raise InjectionError(f"target {rule!r}: every running node is down by an earlier "
                                 "fault of this burst")
        if notes is not None:
            notes["retargeted_from"] = node.name
        node = rng.choice(running)
    if node is None:
        raise InjectionError(f"target {rule!r}: no such running node")
    return node


def progress_records(node: DaemonNode) -> list[dict]:
    """The workers' progress lines of ``node``, in order (every incarnation)."""
    return [r for r in node.log_events() if r.get("kind") == "progress"]


def _wait(predicate: Callable[[], bool], timeout_s: float) -> bool:
    return proctree.wait_for(predicate, timeout_s, 0.1)


@dataclass
class _Fired:
    """An injected fault of a burst: its record, and its heal running beside what follows."""

    rec: FaultRecord
    injector: Injector
    victim: DaemonNode | None
    old: set[tuple[int, float] | None]
    healer: threading.Thread

    def hit(self, t: Target) -> DaemonNode | None:
        return self.victim or t.nodes.get(self.rec.detail.get("node", ""))


def _inject(i: int, spec: FaultSpec, cluster_nodes: list[DaemonNode], t: Target,
            rng: random.Random, say: Say, busy: frozenset[str],
            overlap: Detail) -> tuple[FaultRecord, _Fired | None]:
    """Inject fault ``i`` and start its hold and heal in a thread of their own (a fault of
    the same burst may fire meanwhile)."""
    rec = FaultRecord(i, spec.kind, spec.when(), detail=dict(overlap))
    injector = INJECTORS[spec.kind](spec.for_s)
    try:
        victim = resolve_target(spec, injector, t, rng, busy, rec.detail)
        rec.target = victim.name if victim else None
        rec.step = _step_now(cluster_nodes)
        old = {_identity(p) for n in t.running() for p in workers_of(n)}
        rec.t_inject = time.time()
        rec.detail |= injector.inject(t, victim)
        if "t_fired" in rec.detail:   # an injector that waited for its moment (a log line)
            rec.t_inject = rec.detail.pop("t_fired")
            rec.step = _step_now(cluster_nodes)
    except InjectionError as exc:
        rec.error = f"not injected: {exc}"
        rec.t_inject = None
        say(f"fault {i} {spec.kind}: {rec.error}")
        return rec, None
    healer = threading.Thread(target=_heal, args=(rec, injector, t, victim), daemon=True,
                              name=f"heal-{i}-{spec.kind}")
    healer.start()
    return rec, _Fired(rec, injector, victim, old, healer)


# Set once the run's cluster is gone: a heal thread lives until then, because a process
# it started (an etcd member) has PR_SET_PDEATHSIG tied to the thread that forked it
# (proctree.with_parent_death_signal) and would die with the thread (seen: etcd restarted
# by a heal thread was gone as soon as the heal returned, and the job never saw etcd again).
_RUN_OVER = threading.Event()


def _heal(rec: FaultRecord, injector: Injector, t: Target, victim: DaemonNode | None) -> None:
    try:
        time.sleep(injector.hold_s)
        rec.detail |= injector.heal(t, victim)
    except InjectionError as exc:
        rec.error = f"not healed: {exc}"
    rec.t_heal = time.time()
    _RUN_OVER.wait()


class _Tail:
    """The JSON lines a log gained since the last read (a restarted node appends)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""

    def new(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:   # truncated: start again
                    self.offset, self.rest = 0, b""
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        return [r for line in lines if (r := _json_object(line.decode(errors="replace")))]


def _json_object(line: str) -> dict | None:
    start = line.find("{")
    if start < 0:
        return None
    with contextlib.suppress(ValueError):
        value = json.loads(line[start:])
        return value if isinstance(value, dict) else None
    return None


def await_phase(spec: FaultSpec, since: float, nodes: list[DaemonNode],
                timeout_s: float = PHASE_TIMEOUT_S) -> Detail:
    """Wait until ``spec.during`` began after ``since`` (a daemon's log line on any node,
    scenario.PHASES), then ``spec.gap_s`` more; what was seen, for the fault's record. A
    phase that never comes within ``timeout_s`` lets the fault fire then, marked unseen."""
    needle = PHASES[spec.during or "inject"]
    seen: tuple[float, str | None] | None = None if needle else (since, None)
    tails = {n.name: _Tail(n.log_path) for n in nodes} if needle else {}

    def began() -> bool:
        nonlocal seen
        for name, tail in tails.items():
            for r in tail.new():
                at = record_time(r)
                if at is not None and at >= since and needle in str(r.get("event", "")):
                    seen = (at, name)
                    return True
        return False

    if seen is None:
        _wait(began, timeout_s)
    if seen is None:
        at, detail = time.time(), {"phase": spec.during, "phase_seen": False}
    else:
        at = seen[0]
        detail = {"phase": spec.during, "phase_at": round(at, 3), "phase_node": seen[1]}
    time.sleep(max(0.0, at + (spec.gap_s or 0.0) - time.time()))
    return {"overlap": detail}


def _burst(first: int, specs: list[FaultSpec], cluster_nodes: list[DaemonNode], t: Target,
           rng: random.Random, say: Say) -> list[FaultRecord]:
    """One fault, and those written to overlap it (``during``): each fires in its phase of
    the previous one's recovery while the earlier ones still heal; they recover as one."""
    records: list[FaultRecord] = []
    fired: list[_Fired] = []
    for k, spec in enumerate(specs):
        overlap: Detail = {}
        if spec.during is not None:
            since = next((r.t_inject for r in reversed(records) if r.t_inject), time.time())
            overlap = await_phase(spec, since, cluster_nodes)
        busy = frozenset(f.victim.name for f in fired if f.victim and f.rec.t_heal is None)
        rec, done = _inject(first + k, spec, cluster_nodes, t, rng, say, busy, overlap)
        records.append(rec)
        if done is not None:
            fired.append(done)
    if fired:
        _recover(fired, cluster_nodes, t, say)
    return records


def _recover(fired: list[_Fired], cluster_nodes: list[DaemonNode], t: Target, say: Say) -> None:
    """Wait for every heal, then for a world of N, stable, with each hit node that must
    have new workers running them; every record of the burst gets that moment."""
    for f in fired:
        while f.rec.t_heal is None and f.healer.is_alive():   # the thread lives on (_RUN_OVER)
            time.sleep(0.05)
        say(f"fault {f.rec.index} {f.rec.kind} on {f.rec.target or 'the cluster'} at step "
            f"{f.rec.step}: {f.rec.detail}")
    n = len(cluster_nodes)
    renew = [(hit, f.old) for f in fired if f.injector.replaces_workers and (hit := f.hit(t))]
    extra = (lambda: all(replaced(hit, old) for hit, old in renew)) if renew else None
    since = max(f.rec.t_heal or time.time() for f in fired)
    t_recovered = wait_stable(cluster_nodes, n, since, RECOVER_TIMEOUT_S, extra=extra,
                              abort=lambda: completed(cluster_nodes))
    first = fired[0].rec
    if t_recovered is not None:
        say(f"  recovered: a world of {n} again after {t_recovered - first.t_inject:.1f} s")
    elif completed(cluster_nodes):
        error = (f"the job completed before a world of {n} was back: the scenario needs a "
                 "later final_step (or a larger step_sleep)")
    else:
        error = f"no world of {n} within {RECOVER_TIMEOUT_S:.0f} s of the heal"
        say(f"  {error}")
    for f in fired:
        f.rec.t_recovered = t_recovered
        if t_recovered is None:
            f.rec.error = f.rec.error or error


def replaced(node: DaemonNode, old: set[tuple[int, float] | None]) -> bool:
    """``node`` runs workers and none of them is one of ``old`` ((pid, start time): a
    reused pid is another process)."""
    now = {_identity(p) for p in workers_of(node)} - {None}
    return bool(now) and not now & old


def wait_stable(nodes: list[DaemonNode], world: int, since: float, timeout_s: float,
                settle_s: float = SETTLE_S, clock: Callable[[], float] = time.time,
                extra: Callable[[], bool] | None = None,
                abort: Callable[[], bool] | None = None) -> float | None:
    """The moment from which every node has stepped in a world of ``world`` (each within
    FRESH_S of every poll) and ``extra()`` held, for ``settle_s`` without a break, after
    ``since``; None if that did not happen within ``timeout_s`` or ``abort()`` came first."""
    start: float | None = None
    aborted = False

    def settled() -> bool:
        nonlocal start, aborted
        if abort and abort():
            aborted = True
            return True
        now = clock()
        if not stepping_at(nodes, world, max(since, now - FRESH_S)) or (extra and not extra()):
            start = None
            return False
        start = now if start is None else start
        return now - start >= settle_s

    return start if _wait(settled, timeout_s + settle_s) and not aborted else None


def completed(nodes: list[DaemonNode]) -> bool:
    """Some node's workers reported the job's completion (or no daemon runs any more)."""
    return _ended(nodes) or any((n.progress() or {}).get("event") == "completed" for n in nodes)


def _finish_timeout(sc: Scenario, step: int = 0) -> float:
    # The steps left at a loaded machine's pace (measured: 0.3 s a step beyond the sleep
    # at a load average of 50 on 2 cores), plus a restart's worth.
    return (sc.final_step - step) * (sc.step_sleep + 0.3) + 120


def run_scenario(sc: Scenario, root: Path, *, job: str = "chaos", run: Run = RUN,
                 say: Say = print) -> RunResult:
    """Run ``sc`` in ``root`` (configs, logs, checkpoints stay there) and collect what the
    invariants need; every process started is gone when this returns."""
    proctree.become_subreaper()   # orphaned workers re-parent here, where they are seen
    _RUN_OVER.clear()
    root.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    faults: list[FaultRecord] = []
    t_formed = None
    error = None
    rng = random.Random(sc.seed)
    before = _identities()
    try:
        with local_cluster(root, etcd_members=sc.etcd_members, network=needs_network(sc)) as cluster, \
                metadata_servers(sc) as metadata:
            nodes = _start_nodes(cluster, sc, job, run, metadata)
            target = Target({n.name: n for n in nodes}, cluster.etcd, root / "ckpt", LEASE_TTL_S,
                            metadata=metadata)
            say(f"scenario {sc.name or sc.seed}: {sc.nodes} nodes, {len(sc.faults)} faults, "
                f"final step {sc.final_step}, root {root}")
            if _wait(lambda: stepping_at(nodes, sc.nodes, 0) and _step_now(nodes) >= 5, FORM_TIMEOUT_S):
                t_formed = time.time()
                say(f"a world of {sc.nodes} at step {_step_now(nodes)}")
                error = _fault_loop(sc, nodes, target, rng, t_formed, faults, say)
                codes = _finish(nodes, sc, say)
            else:
                error = f"no world of {sc.nodes} within {FORM_TIMEOUT_S:.0f} s"
                codes = {n.name: n.proc.poll() if n.proc else None for n in nodes}
            progress = {n.name: progress_records(n) for n in nodes}
            daemon = {n.name: [e for e in n.daemon_events() if "etcd" in str(e.get("event", ""))]
                      for n in nodes}
            etcd = f"{cluster.etcd.binary} ({etcd_version(cluster.etcd.binary)})"
    finally:
        _RUN_OVER.set()   # the cluster is gone: the heal threads may end
    proctree.reap_children()
    left = [*cluster.leftover, *(describe(p) for p in proctree.descendants()
                                 if _identity(p) not in before)]
    return RunResult(sc, root, run, faults, t_start, t_formed, time.time(), codes, progress,
                     dict(target.corrupted), left, error, etcd, daemon)


def needs_network(sc: Scenario) -> bool:
    """Whether a fault of ``sc`` acts on links: the cluster then runs on its own network
    (every node and the etcd in a namespace, elasticd.lab.netlab) instead of loopback."""
    return any(INJECTORS[f.kind].network for f in sc.faults)


def _identities() -> set[tuple[int, float]]:
    return {i for p in proctree.descendants() if (i := _identity(p))}


@contextlib.contextmanager
def metadata_servers(sc: Scenario) -> Iterator[dict[str, FakeMetadata]]:
    """One fake GCE metadata server per node (127.0.0.1) if a planned fault needs them
    (a preemption notice is for one VM), else none; all stopped at the end."""
    with contextlib.ExitStack() as stack:
        needed = any(INJECTORS[f.kind].needs_metadata for f in sc.faults)
        yield {name: stack.enter_context(FakeMetadata()) for name in sc.node_names()} if needed else {}


def _sections(sc: Scenario, server: FakeMetadata | None) -> str:
    """The node's extra config sections: its rendezvous layout, a preemption notice's server."""
    out = f'[rendezvous]\nrounds = "{sc.rounds}"\n'
    if server is not None:
        out += f'[preemption]\ngce = true\nmetadata_url = "{server.url}"\npoll_interval_s = 0.2\n'
    return out


def _supervisor_lines(sc: Scenario) -> str:
    """The scenario's [supervisor] settings as TOML lines (the section write_config opens)."""
    return "".join(f"{key} = {json.dumps(value)}\n" for key, value in sc.supervisor.items())


def _start_nodes(cluster: Cluster, sc: Scenario, job: str, run: Run,
                 metadata: dict[str, FakeMetadata]) -> list[DaemonNode]:
    # min_nodes N-1: a node away for a fault must not block the others' rendezvous; the
    # runner waits for the first world of N before any fault.
    return [cluster.daemon(name, job, entrypoint=entrypoint(sc, run), every_steps=sc.every_steps,
                           min_nodes=max(1, sc.nodes - 1), max_nodes=sc.nodes,
                           lease_ttl_s=LEASE_TTL_S, sections=_sections(sc, metadata.get(name)),
                           extra=_supervisor_lines(sc))
            for name in sc.node_names()]


def _fault_loop(sc: Scenario, nodes: list[DaemonNode], target: Target, rng: random.Random,
                t_formed: float, faults: list[FaultRecord], say: Say) -> str | None:
    for first, specs in bursts(sc.faults):
        spec = specs[0]
        _wait(lambda spec=spec: _due(spec, nodes, t_formed) or _ended(nodes), _finish_timeout(sc))
        if _ended(nodes):
            faults.extend(FaultRecord(j, s.kind, s.when(), error="not fired: the job had ended")
                          for j, s in enumerate(sc.faults[first:], start=first))
            return f"the job ended before fault {first} ({spec.kind}) fired: raise final_step"
        records = _burst(first, specs, nodes, target, rng, say)
        faults.extend(records)
        stuck = [r for r in records if r.t_inject is not None and r.t_recovered is None]
        if stuck:
            nxt = first + len(specs)
            faults.extend(FaultRecord(j, s.kind, s.when(), error="not fired: an earlier fault never "
                                      "recovered") for j, s in enumerate(sc.faults[nxt:], start=nxt))
            return f"fault {stuck[0].index} ({stuck[0].kind}) never recovered"
    return None


def bursts(faults: Sequence[FaultSpec]) -> list[tuple[int, list[FaultSpec]]]:
    """The faults grouped into bursts: one at a step or time and those that follow it in
    a phase of its recovery (``during``), each with the index of its first fault."""
    out: list[tuple[int, list[FaultSpec]]] = []
    for i, spec in enumerate(faults):
        if spec.during is not None and out:
            out[-1][1].append(spec)
        else:
            out.append((i, [spec]))
    return out


def _ended(nodes: list[DaemonNode]) -> bool:
    """No daemon runs any more: the job completed (or everything died)."""
    return not any(n.running() for n in nodes)


def _finish(nodes: list[DaemonNode], sc: Scenario, say: Say) -> dict[str, int | None]:
    """Every daemon exits by itself once the job completes (None: it had to be killed)."""
    if _wait(lambda: not any(n.running() for n in nodes), _finish_timeout(sc, _step_now(nodes))):
        say(f"job completed at step {_step_now(nodes) or sc.final_step}")
    else:
        say("the job did not complete in time")
    return {n.name: (n.proc.poll() if n.proc else None) for n in nodes}
