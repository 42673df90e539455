"""Goodput through a preemption trace: elasticd (in place) vs tuned plain torchrun (c10d).

One invocation runs, one after the other, on 4 loopback "nodes" (1 CPU worker each,
``trainer/examples/mlp.py`` as in ``mttr.py``, a checkpoint every 20 steps to a shared
directory, min 2 / max 4 nodes):

* a fault-free reference of each system (``--ref-s``), which gives its fault-free step rate;
* the same seeded fault trace (``draw_trace``) under each system, ``--duration-s`` long,
  counted from the first step of the world of 4.

Systems (``--systems``):

    elasticd  4 daemons (``python -m elasticd run``, ``[recovery] mode = "in-place"``, lease
              TTL 5 s) against a real etcd that is never faulted
    torchrun  plain torchrun, c10d rendezvous tuned as ``mttr.py``'s system b, its store hosted
              by a separate ``TCPStore`` process that is never faulted (an operator's best
              set-up: with the store on a node's agent, that node's death ends the job)

Trace (``draw_trace``, a pure function of the seed): fault arrivals are exponential with mean
``--mtbf-s``; each fault's kind is drawn from shuffled bags of ``MIX`` (2 crashes, 1 silent,
1 drain per bag, so a short trace still mixes them), its victim at random among the nodes in
the job (rank 0 included: the node does not know its rank in advance):

    crash   SIGKILL of the node's whole tree (daemon or agent, workers) at once
    silent  SIGSTOP of the whole tree; ``--silent-s`` later SIGKILL (the hung machine is
            power-cycled by its watchdog): a frozen node, then a dead one
    drain   SIGTERM to the daemon (``elasticd``'s graceful drain) or to the agent (torchrun)
    rejoin  ``--rejoin-after-s`` after a node is gone (killed, drained), a fresh node with a
            new name starts and the world grows back

A fault that would leave fewer than ``min_nodes`` nodes in the job, or that finds no node that
has been in it for ``SETTLED_S``, is deferred to just after the next rejoin. No fault in the
last ``QUIET_TAIL_S`` of the trace.

Goodput = useful steps / fault-free steps in the same wall time, where useful steps is the
length of the final committed history at the end of the window (the step the job holds;
steps redone after a rollback count once; if the job is rolled back just after the end, to
the step it resumed from), and fault-free steps = the system's own fault-free rate x the
window. Also reported against the faster system's fault-free rate (one yardstick for both).

    python -m benchmarks.goodput [--duration-s 300] [--seed 1] [--mtbf-s 60] [--ref-s 60]
                                 [--systems elasticd,torchrun] [--name goodput]

Writes ``NAME.json`` (trace, settings, load, every run's step timeline) and ``NAME.md``
under ``--out``. Every run kills whatever it started (this process is the child subreaper).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.mttr import (  # noqa: E402
    TUNED_CONF,
    _raise_interrupt,
    finish_run,
    inject,
    loadavg,
    machine,
    wait_quiet,
)
from elasticd import proctree  # noqa: E402
from elasticd.contract.progress import NO_HISTORY, WORKING  # noqa: E402
from elasticd.lab.chaos import liveness  # noqa: E402
from elasticd.lab.embedded_etcd import free_port  # noqa: E402
from elasticd.lab.local_cluster import (  # noqa: E402
    MLP,
    TRAIN_ARGS,
    Cluster,
    Node,
    kill_descendants,
    local_cluster,
    record_time,
)

NODES, MIN_NODES = 4, 2
LEASE_TTL_S = 5
CHECKPOINT_EVERY = 20
SYSTEMS = {"elasticd": "elasticd, in-place", "torchrun": "torchrun c10d, tuned"}
REMOVALS = ("crash", "silent", "drain")
KINDS = (*REMOVALS, "rejoin")
MIX: dict[str, int] = {"crash": 2, "silent": 1, "drain": 1}   # one bag of kinds
WARMUP_S = 15.0      # no fault before this (seconds after the first step of the world of 4)
QUIET_TAIL_S = 20.0  # no fault in the trace's last seconds
DEFER_S = 5.0        # a fault deferred for min_nodes comes this long after the rejoin
SETTLED_S = 15.0     # a victim has been in the job at least this long (a fresh node too)
POLL_S = 0.05
GRACE_CAP_S = 150.0  # after the window: how long to wait for the job's next step
STEP_EVENTS = WORKING   # the progress events of a group that trains
STORE_CODE = ("import sys, time\nfrom torch.distributed import TCPStore\n"
              "s = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False,"
              " multi_tenant=True)\nprint('store ready', flush=True)\ntime.sleep(1e9)\n")


# -- the trace (pure) ----------------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    """One trace event: ``t`` seconds after the world first formed, ``kind`` in KINDS,
    on node ``node`` (for a rejoin, the fresh node that starts)."""

    t: float
    kind: str
    node: str


def draw_trace(seed: int, duration_s: float, mtbf_s: float = 60.0, mix: dict[str, int] | None = None,
               nodes: int = NODES, min_nodes: int = MIN_NODES, rejoin_after_s: float = 20.0,
               silent_s: float = 30.0, warmup_s: float = WARMUP_S,
               quiet_tail_s: float = QUIET_TAIL_S) -> list[Fault]:
    """The seeded fault trace, sorted by time: removals (crash, silent, drain) with
    exponential inter-arrival times of mean ``mtbf_s`` in ``[warmup_s, duration_s -
    quiet_tail_s]``, kinds from shuffled bags of ``mix``, each followed ``rejoin_after_s``
    after its node is gone (a silent node is gone ``silent_s`` after it froze) by the
    rejoin of a fresh node, if that is before ``duration_s - quiet_tail_s / 2``.

    Never fewer than ``min_nodes`` nodes in the job: a removal that would go below, or that
    finds no node in the job for ``SETTLED_S`` (a fresh node must have joined the world
    first), is deferred to ``DEFER_S`` after the next rejoin or settling (the arrivals
    continue from there).
    """
    if nodes <= min_nodes:
        raise ValueError(f"nodes={nodes} must exceed min_nodes={min_nodes}")
    mix = MIX if mix is None else mix
    rng = random.Random(seed)
    joined = {f"n{i}": float("-inf") for i in range(nodes)}   # node in the job -> since when
    next_id = nodes
    pending: list[tuple[float, str]] = []   # (rejoin time, fresh node)
    out: list[Fault] = []
    bag: list[str] = []
    last_fault = duration_s - quiet_tail_s
    t = warmup_s + rng.expovariate(1.0 / mtbf_s)
    while t <= last_fault:
        for rejoin in sorted(p for p in pending if p[0] <= t):
            pending.remove(rejoin)
            joined[rejoin[1]] = rejoin[0]
            out.append(Fault(round(rejoin[0], 3), "rejoin", rejoin[1]))
        settled = [n for n, since in joined.items() if since <= t - SETTLED_S]
        if len(joined) - 1 < min_nodes or not settled:
            t = min([p[0] for p in pending] + [s + SETTLED_S for s in joined.values() if s > t - SETTLED_S]
                    ) + DEFER_S
            continue
        if not bag:
            bag = [k for k, n in mix.items() for _ in range(n)]
            rng.shuffle(bag)
        kind = bag.pop()
        victim = rng.choice(settled)
        del joined[victim]
        out.append(Fault(round(t, 3), kind, victim))
        gone = t + (silent_s if kind == "silent" else 0.0)
        pending.append((gone + rejoin_after_s, f"n{next_id}"))
        next_id += 1
        t += rng.expovariate(1.0 / mtbf_s)
    out += [Fault(round(at, 3), "rejoin", name) for at, name in pending
            if at <= duration_s - quiet_tail_s / 2]
    return sorted(out, key=lambda f: f.t)


def alive_over_trace(trace: list[Fault], nodes: int = NODES) -> list[tuple[float, int]]:
    """(time, nodes in the job just after the event) for every event of ``trace``."""
    count, out = nodes, []
    for fault in trace:
        count += 1 if fault.kind == "rejoin" else -1
        out.append((fault.t, count))
    return out


def available_node_seconds(sent: list[dict[str, Any]], window_s: float, nodes: int = NODES) -> float:
    """Node-seconds of capacity the trace left the job within ``[0, window_s]``: ``nodes``
    at the start, one fewer from each removal (``kill``, ``stop``: a frozen node trains
    nothing; ``term``), one more from each ``start``; the kill that ends a stopped node
    removes nothing more. ``sent``: the actions as sent (``measure_trace``)."""
    count, total, last, stopped = nodes, 0.0, 0.0, set()
    for action in sorted(sent, key=lambda a: a["t"]):
        t = min(max(action["t"], 0.0), window_s)
        total += count * (t - last)
        last = t
        if action["action"] == "start":
            count += 1
        elif action["action"] == "kill" and action["node"] in stopped:
            stopped.discard(action["node"])
        else:
            count -= 1
            if action["action"] == "stop":
                stopped.add(action["node"])
    return total + count * (window_s - last)


def actions(trace: list[Fault], silent_s: float) -> list[tuple[float, str, str]]:
    """The trace as signals to send, sorted: (t, action, node), action in kill (crash; the
    end of a silent node), stop (silent), term (drain), start (rejoin)."""
    what = {"crash": "kill", "silent": "stop", "drain": "term", "rejoin": "start"}
    out = [(f.t, what[f.kind], f.node) for f in trace]
    out += [(round(f.t + silent_s, 3), "kill", f.node) for f in trace if f.kind == "silent"]
    return sorted(out)


# -- goodput arithmetic on a step timeline (pure) ----------------------------------------------
# A timeline is the progress records seen (any node), sorted by their ``time``; each says
# "the job's history holds ``step`` steps" at that time (a ``resumed`` or ``reformed``
# record: the step the world continues from; a ``step`` or ``checkpoint``: steps done).

def of_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that speak for the job's history: not a newcomer's ``warm`` (its step 0
    is its own, not a rollback of the job's)."""
    return [r for r in records if r.get("event") not in NO_HISTORY]


def history_at(records: list[dict[str, Any]], t_end: float) -> int | None:
    """The length of the committed history at ``t_end``: the newest record's step at or
    before it, lowered to the lowest step seen after it (a rollback just after the end
    undoes the steps it did not keep). None before the first record."""
    records = of_history(records)
    before = [r for r in records if r["time"] <= t_end]
    if not before:
        return None
    held = max(before, key=lambda r: r["time"])["step"]
    after = [r["step"] for r in records if r["time"] > t_end]
    return min([held, *after])


def history_worlds(records: list[dict[str, Any]], t_end: float) -> list[int]:
    """The world size each step of the history held at ``t_end`` (``history_at``) was done
    in: ``worlds[i]`` for step ``i + 1``. Records are samples (the progress files are read a
    few times a second), so the steps between two records count in the later one's world;
    a record below the history so far (a rollback, or the step a re-formed world continues
    from) cuts it there, and the steps redone after it replace the cut ones."""
    held = history_at(records, t_end)
    if held is None:
        return []
    records = of_history(records)
    worlds: list[int] = []
    for r in sorted((r for r in records if r["time"] <= t_end), key=lambda r: r["time"]):
        step, world = r["step"], r.get("world_size")
        if step < len(worlds):
            del worlds[step:]
        elif step > len(worlds) and world:
            worlds.extend([world] * (step - len(worlds)))
    return worlds[:held]


def step_rate(records: list[dict[str, Any]], skip_s: float = 5.0) -> float | None:
    """Steps per second between the first step record ``skip_s`` after the first one and
    the last (a fault-free run: one world, no rollback)."""
    steps = [r for r in records if r.get("event") in STEP_EVENTS]
    if not steps:
        return None
    start = next((r for r in steps if r["time"] >= steps[0]["time"] + skip_s), None)
    end = steps[-1]
    if start is None or end["time"] <= start["time"]:
        return None
    return (end["step"] - start["step"]) / (end["time"] - start["time"])


def goodput(useful: int, rate: float, window_s: float) -> float:
    """useful steps / the steps a fault-free run at ``rate`` makes in ``window_s``."""
    return useful / (rate * window_s)


def sample_goodput(useful_rank_steps: int, rate: float, window_s: float, nodes: int = NODES) -> float:
    """Useful samples / the samples a fault-free run of ``nodes`` makes in ``window_s``.

    Each rank trains a fixed batch per step, so a step of a world of W is W rank-steps of
    samples: a job that steps as fast on 2 of its 4 nodes (the step is sleep-bound here)
    trains half as much per step. This is the headline: the step count alone rewards a
    system that never re-admits its rejoining nodes (measured: tuned c10d stayed at 2-3
    nodes for most of the trace and scored 100 % in steps)."""
    return useful_rank_steps / (rate * window_s * nodes)


def event_outcome(records: list[dict[str, Any]], t_event: float,
                  t_next: float = float("inf")) -> dict[str, Any]:
    """What the job did after an event at ``t_event``, before the next one at ``t_next``
    (later steps are that event's): the first step in a world of another size
    (``recovery_s`` after the event), the ``pause_s`` from the old world's last step
    record to it, the step it continued from and the ``steps_lost`` (the old world's last
    step minus that), the ``path`` (in-place: a ``reformed`` record; restart: ``resumed``)."""
    before = [r for r in records if r["time"] <= t_event and r.get("event") in STEP_EVENTS]
    if not before:
        return {"recovered": False, "note": "no step before the event"}
    old = before[-1]["world_size"]
    new = next((r for r in records if t_event < r["time"] < t_next and r.get("event") in STEP_EVENTS
                and r["world_size"] != old), None)
    if new is None:
        return {"recovered": False, "old_world": old,
                "note": "no step of a new world before the next event" if t_next < float("inf")
                else "no step of a new world"}
    between = [r for r in records if t_event < r["time"] < new["time"]]
    old_steps = [r for r in before[-1:] + between if r["world_size"] == old and r.get("event") in STEP_EVENTS]
    last_old = max(old_steps, key=lambda r: r["time"])
    marks = [r for r in between
             if r.get("event") in ("resumed", "reformed") and r["world_size"] == new["world_size"]]
    cont = marks[-1]["step"] if marks else new["step"] - 1
    path = marks[-1]["event"] if marks else None
    return {"recovered": True, "old_world": old, "new_world": new["world_size"],
            "recovery_s": round(new["time"] - t_event, 3),
            "pause_s": round(new["time"] - last_old["time"], 3),
            "old_last_step": max(r["step"] for r in old_steps), "continued_from": cont,
            "steps_lost": max(0, max(r["step"] for r in old_steps) - cont),
            "path": {"reformed": "in-place", "resumed": "restart"}.get(path or "", "unseen")}


LIVENESS_BOUND_S = LEASE_TTL_S + liveness.RESTART_BOUND_S   # the invariant's bound
PAUSE_TARGET_S = LEASE_TTL_S + 5.0   # issue 29: the longest pause of a trace, at most


def out_intervals(sent: list[dict[str, Any]], nodes: int = NODES) -> dict[str, list[tuple[float, float]]]:
    """When each node was out of the job (``liveness``): a fresh node before its start; a
    node from its kill, stop (frozen) or drain on, for good (a node never comes back under
    its name: its replacement is a fresh one). ``sent``: the actions as sent, t from t0."""
    out: dict[str, list[tuple[float, float]]] = {f"n{i}": [] for i in range(nodes)}
    for action in sorted(sent, key=lambda a: a["t"]):
        name, t = action["node"], action["t"]
        if action["action"] == "start":
            out[name] = [(float("-inf"), t)]
        elif not any(end == float("inf") for _, end in out.setdefault(name, [])):
            out[name].append((t, float("inf")))
    return out


def liveness_of(records: list[dict[str, Any]], sent: list[dict[str, Any]], t0: float,
                t1: float) -> dict[str, Any]:
    """The liveness invariant over the window (``elasticd.lab.chaos.liveness``), the longest
    pause and the actions sent in the 30 s before it (the fault sequence behind it)."""
    steps = [r["time"] - t0 for r in records if r.get("event") in STEP_EVENTS]
    out = out_intervals(sent)
    found = liveness.pauses(steps, 0.0, t1 - t0)
    worst = liveness.longest(found)
    owed = liveness.violations(steps, out, out, 0.0, t1 - t0, MIN_NODES, LIVENESS_BOUND_S)
    behind = [] if worst is None else [
        f"{a['action']} {a['node']} at {a['t']:.1f}" for a in sent
        if worst.start - 30 <= a["t"] <= worst.end]
    return {"longest_pause_s": None if worst is None else worst.length_s,
            "longest_pause_at_s": None if worst is None else round(worst.start, 3),
            "longest_pause_after": behind,
            "liveness_violations": [{"at_s": v.start, "length_s": v.length_s, "nodes": list(v.nodes)}
                                    for v in owed]}


def pauses(records: list[dict[str, Any]], t0: float, t1: float, min_gap_s: float = 1.0) -> float:
    """Seconds of ``[t0, t1]`` inside gaps of more than ``min_gap_s`` between step records
    (the job did not train; the progress file is rewritten at least every 0.25 s while it
    does). A gap that runs past ``t1`` (to the next step, or forever) counts up to ``t1``."""
    steps = [r["time"] for r in records if r.get("event") in STEP_EVENTS]
    total = 0.0
    for a, b in zip(steps, [*steps[1:], float("inf")], strict=True):
        if b - a > min_gap_s:
            total += max(0.0, min(b, t1) - max(a, t0))
    return total


# -- running a system ----------------------------------------------------------------------

class Job:
    """One system's nodes in a cluster, their progress records and the trace's signals."""

    def __init__(self, system: str, cluster: Cluster, root: Path) -> None:
        self.system = system
        self.cluster = cluster
        self.nodes: dict[str, Node] = {}
        self.job = f"goodput-{system}-{int(time.time() * 1000) % 10**8}"
        self.records: list[dict[str, Any]] = []
        self._seen: set[tuple[str, float]] = set()
        self.store: subprocess.Popen | None = None
        self.port = 0
        if system == "torchrun":
            self.port = free_port()
            log = open(root / "store.log", "ab")  # noqa: SIM115 - kept open for the child
            self.store = subprocess.Popen([sys.executable, "-c", STORE_CODE, str(self.port)],
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            log.close()
            deadline = time.monotonic() + 60
            while "store ready" not in (root / "store.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.1)

    def start(self, name: str) -> Node:
        """Start node ``name`` of this job (at the beginning, or a rejoin)."""
        if self.system == "elasticd":
            node = self.cluster.daemon(
                name, self.job, min_nodes=MIN_NODES, max_nodes=NODES, entrypoint=[MLP, *TRAIN_ARGS],
                lease_ttl_s=LEASE_TTL_S, every_steps=CHECKPOINT_EVERY, recovery="in-place",
                # The script's LR at the full world, as plain torchrun runs it: rescaled
                # from a base of 1 the MLP diverged at a world of 4 (0.2 with momentum 0.9)
                # in the first runs, and a diverged job measures nothing about faults.
                sections=f"[lr]\nbase_world_size = {NODES}\n")
        else:
            node = self.cluster.torchrun(
                name, self.job, endpoint=f"127.0.0.1:{self.port}", backend="c10d", is_host=False,
                rdzv_conf=TUNED_CONF, nnodes=f"{MIN_NODES}:{NODES}", max_restarts=1000,
                monitor_interval_s=0.1, script_path=MLP, script_args=TRAIN_ARGS,
                every_steps=CHECKPOINT_EVERY, env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        self.nodes[name] = node
        return node

    def poll(self) -> None:
        """Add every node's newest progress record not seen yet to ``records``."""
        for name, node in self.nodes.items():
            rec = node.progress()
            if not rec or not isinstance(rec.get("time"), float) or (name, rec["time"]) in self._seen:
                continue
            self._seen.add((name, rec["time"]))
            self.records.append({"time": rec["time"], "step": rec.get("step"), "event": rec.get("event"),
                                 "world_size": rec.get("world_size"), "node": name})

    def sleep_until(self, t_wall: float) -> None:
        while (left := t_wall - time.time()) > 0:
            self.poll()
            time.sleep(min(POLL_S, left))
        self.poll()

    def formed(self) -> float | None:
        """Time of the first step record of a world of NODES, if any."""
        return next((r["time"] for r in sorted(self.records, key=lambda r: r["time"])
                     if r["world_size"] == NODES and r["event"] in STEP_EVENTS), None)

    def act(self, action: str, name: str) -> float:
        """Send one trace action; the wall time it was sent."""
        if action == "start":
            now = time.time()
            self.start(name)
            return now
        node = self.nodes[name]
        if action == "kill" and not node.running():
            return time.time()   # a drained node that already left
        return inject(node, {"kill": "crash", "stop": "silent", "term": "drain"}[action])

    def timeline(self) -> list[dict[str, Any]]:
        return sorted((r for r in self.records if r["step"] is not None), key=lambda r: r["time"])

    def worker_events(self, event: str) -> list[tuple[str, float, int | None]]:
        """(node, time, step) of the workers' ``event`` log lines on every node."""
        return sorted(((n, t, r.get("step")) for n, node in self.nodes.items()
                       for r in node.worker_events(event) if (t := record_time(r)) is not None),
                      key=lambda x: x[1])


def clusters_of(events: list[tuple[str, float, int | None]], gap_s: float = 5.0) -> int:
    """How many bursts of events (nodes' lines within ``gap_s`` of each other are one)."""
    count, last = 0, None
    for _, t, _ in events:
        if last is None or t - last > gap_s:
            count += 1
        last = t
    return count


def run_system(system: str, trace: list[Fault], duration_s: float, silent_s: float,
               formation_s: float = 240.0, keep: bool = False) -> dict[str, Any]:
    """Start NODES nodes of ``system``, wait for the world of 4, play ``trace`` (empty: a
    fault-free run) for ``duration_s`` from its first step, measure, tear everything down."""
    root = Path(tempfile.mkdtemp(prefix=f"goodput-{system}-"))
    out: dict[str, Any] = {"system": system, "faulted": bool(trace), "duration_s": duration_s,
                           "load_start": loadavg()}
    cluster = None
    try:
        with local_cluster(root, etcd=system == "elasticd") as cluster:
            job = Job(system, cluster, root)
            for i in range(NODES):
                job.start(f"n{i}")
            deadline = time.time() + formation_s
            while job.formed() is None and time.time() < deadline:
                job.sleep_until(time.time() + 0.2)
            t0 = job.formed()
            if t0 is None:
                return out | {"outcome": "setup timeout",
                              "log_tail": {n: node.log_tail(1500) for n, node in job.nodes.items()}}
            t_end = t0 + duration_s
            out |= measure_trace(job, trace, t0, t_end, silent_s)
            out["nodes_started"] = list(job.nodes)
    finally:
        finish_run(out, cluster, root, keep)
    return out


def measure_trace(job: Job, trace: list[Fault], t0: float, t_end: float, silent_s: float) -> dict[str, Any]:
    """Play the trace's actions at their times, then wait for the job's next step (the
    grace: a silent node's kill still due is sent), and take the measures."""
    todo = actions(trace, silent_s)
    sent: list[dict[str, Any]] = []
    loads: list[float] = []
    next_load = time.time()
    for t, action, name in todo:
        if t0 + t > t_end and action != "kill":
            continue
        while time.time() < t0 + t:
            job.sleep_until(min(t0 + t, time.time() + 1.0))
            if time.time() >= next_load:
                loads.append(loadavg()[0])
                next_load = time.time() + 10
        sent.append({"t": round(job.act(action, name) - t0, 3), "action": action, "node": name})
        print(f"  {job.system} +{t:6.1f} s {action} {name}", file=sys.stderr, flush=True)
    while time.time() < t_end:
        job.sleep_until(min(t_end, time.time() + 1.0))
        if time.time() >= next_load:
            loads.append(loadavg()[0])
            next_load = time.time() + 10
    # Grace: the job's next step after the end (and after the last action) says what it kept.
    last_action = max([t_end, *(t0 + s["t"] for s in sent)])
    grace_deadline = time.time() + GRACE_CAP_S
    while time.time() < grace_deadline:
        job.sleep_until(time.time() + 0.5)
        if any(r["time"] > last_action + 1.0 and r["event"] in STEP_EVENTS for r in job.records):
            break
    job.sleep_until(time.time() + 1.0)
    records = job.timeline()
    survived = any(r["time"] > t_end and r["event"] in STEP_EVENTS for r in records)
    useful = history_at(records, t_end) or 0
    rank_steps = sum(history_worlds(records, t_end))
    window = t_end - t0
    starts = {(s["action"], s["node"]): s["t"] for s in sent}
    played = [(f, starts[key]) for f in trace
              if (key := (actions([f], silent_s)[0][1], f.node)) in starts]
    per_event = []
    for i, (fault, t_sent) in enumerate(played):
        t_next = t0 + played[i + 1][1] if i + 1 < len(played) else float("inf")
        per_event.append({**asdict(fault), "sent_t": t_sent,
                          **event_outcome(records, t0 + t_sent, t_next)})
    resumed, reformed = job.worker_events("resumed"), job.worker_events("reformed")
    in_window = [r for r in records if t0 <= r["time"] <= t_end]
    return {"outcome": "survived" if survived else "job lost", "t0": t0, "window_s": round(window, 3),
            "useful_steps": useful, "useful_rank_steps": rank_steps,
            "steps_at_end_seen": max((r["step"] for r in in_window), default=0),
            "events": per_event, "sent": sent, "load_1m_samples": loads,
            "paused_s": round(pauses(records, t0, t_end), 3),
            "worker_restarts": clusters_of([e for e in resumed if t0 < e[1] <= t_end]),
            "inplace_reforms": clusters_of([e for e in reformed if t0 < e[1] <= t_end]),
            "rate_in_window": round(useful / window, 3),
            **liveness_of(records, sent, t0, t_end), "timeline": records}


# -- report --------------------------------------------------------------------------------

def rescore(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with each faulted run's useful steps and samples computed again from its
    saved timeline (a report written before a fix of the history's arithmetic)."""
    for run in report["runs"]:
        if run["faulted"] and run.get("timeline") and "useful_steps" in run:
            t_end = run["t0"] + run["window_s"]
            run["useful_steps"] = history_at(run["timeline"], t_end) or 0
            run["useful_rank_steps"] = sum(history_worlds(run["timeline"], t_end))
    report["rescored"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return report


def summarize(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per system: goodput against its own fault-free rate and the best one, and the figures."""
    runs = report["runs"]
    refs = {r["system"]: r.get("fault_free_rate") for r in runs if not r["faulted"]}
    best = max((v for v in refs.values() if v), default=None)
    out: dict[str, dict[str, Any]] = {}
    for run in (r for r in runs if r["faulted"] and "useful_steps" in r):
        system, rate = run["system"], refs.get(run["system"])
        window = run["window_s"]
        evs = run["events"]
        by_kind: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            done = [e for e in evs if e["kind"] == kind and e.get("recovered")]
            if any(e["kind"] == kind for e in evs):
                by_kind[kind] = {
                    "n": sum(e["kind"] == kind for e in evs), "recovered": len(done),
                    "recovery_s_median": _median([e["recovery_s"] for e in done]),
                    "pause_s_median": _median([e["pause_s"] for e in done]),
                    "steps_lost_median": _median([e["steps_lost"] for e in done]),
                    "steps_lost_total": sum(e["steps_lost"] for e in done)}
        rank_steps = run.get("useful_rank_steps")
        if rank_steps is None:   # a report written before the samples measure: from its timeline
            rank_steps = sum(history_worlds(run["timeline"], run["t0"] + window))
        out[system] = {
            "sample_goodput": sample_goodput(rank_steps, rate, window) if rate else None,
            "sample_goodput_vs_best": sample_goodput(rank_steps, best, window) if best else None,
            "useful_rank_steps": rank_steps, "mean_world": round(rank_steps / max(run["useful_steps"], 1), 2),
            "available_node_s": round(available := available_node_seconds(run["sent"], window), 1),
            "capacity_goodput": rank_steps / (rate * available) if rate and available else None,
            "goodput": goodput(run["useful_steps"], rate, window) if rate else None,
            "goodput_vs_best": goodput(run["useful_steps"], best, window) if best else None,
            "useful_steps": run["useful_steps"], "fault_free_rate": rate,
            "fault_free_steps": round(rate * window) if rate else None,
            "best_fault_free_steps": round(best * window) if best else None,
            "window_s": window, "survived": run["outcome"] == "survived", "by_kind": by_kind,
            "paused_s": run["paused_s"], "worker_restarts": run["worker_restarts"],
            "inplace_reforms": run["inplace_reforms"],
            "longest_pause_s": run.get("longest_pause_s"),
            "longest_pause_at_s": run.get("longest_pause_at_s"),
            "longest_pause_after": run.get("longest_pause_after", []),
            "liveness_violations": run.get("liveness_violations"),
            "steps_lost_total": sum(e.get("steps_lost", 0) for e in evs if e.get("recovered"))}
    return out


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if value is None else fmt.format(value)


TARGET = 0.82   # torchft's reported goodput at one failure a minute


def markdown(report: dict[str, Any]) -> str:
    s, summary = report["settings"], report.get("summary", {})
    lines = [f"# Goodput through a preemption trace ({s['duration_s']:.0f} s, MTBF {s['mtbf_s']:.0f} s, "
             f"seed {s['seed']})", "",
             f"Generated by `python -m benchmarks.goodput {' '.join(report.get('argv', []))}` at "
             f"{report.get('started', '?')}. Both systems in this one run, one after the other, "
             "through the same trace.", "",
             *([f"Rescored from its saved timeline at {report['rescored']} (`--from-json`): the "
                "history's arithmetic of today's `history_worlds`.", ""] if report.get("rescored") else []),
             "Goodput = useful samples / the samples a fault-free world of 4 trains in the same "
             "wall time (each rank trains a fixed batch per step, so a step of a world of W counts "
             "W/4); the step counts are beside it. \"vs the nodes the trace left\": the same samples "
             "over what the nodes alive at each moment (a removed node is gone until its replacement "
             "starts) would train fault-free: how much of the capacity it was given the system "
             "turned into training.", "",
             "| system | **goodput, samples** (own fault-free rate) | samples (faster rate) | samples vs "
             "the nodes the trace left | mean world "
             "| goodput, steps (own rate) | steps (faster rate) | useful steps | "
             "fault-free steps | faults (crash/silent/drain/rejoin) | recovery s, median by kind | "
             "steps lost, median by kind (total) | pause total s | worker restarts | in-place re-forms | "
             "job survived |", "|---|" + "---|" * 15]
    for system, g in summary.items():
        kinds = g["by_kind"]
        counts = "/".join(str(kinds.get(k, {}).get("n", 0)) for k in KINDS)
        rec = ", ".join(f"{k} {_f(v['recovery_s_median'])}" for k, v in kinds.items())
        lost = ", ".join(f"{k} {_f(v['steps_lost_median'], '{:.0f}')}" for k, v in kinds.items())
        lines.append(
            f"| {SYSTEMS[system]} | **{_pct(g.get('sample_goodput'))}** | "
            f"{_pct(g.get('sample_goodput_vs_best'))} | {_pct(g.get('capacity_goodput'))} | "
            f"{_f(g.get('mean_world'))} | "
            f"{_pct(g['goodput'])} | {_pct(g['goodput_vs_best'])} | {g['useful_steps']} | "
            f"{g['fault_free_steps']} ({_f(g['fault_free_rate'])} steps/s x {g['window_s']:.0f} s) | "
            f"{counts} | "
            f"{rec} | {lost} ({g['steps_lost_total']}) | {g['paused_s']:.1f} | {g['worker_restarts']} | "
            f"{g['inplace_reforms']} | {'yes' if g['survived'] else '**no**'} |")
    lines += ["", "## Against torchft's 82 % at one failure a minute", ""]
    for system, g in summary.items():
        value = g.get("sample_goodput")
        if value is not None:
            verdict = "met" if value > TARGET else "**missed**"
            lines.append(f"- {SYSTEMS[system]}: {_pct(value)} of the samples (vs the faster fault-free "
                         f"rate {_pct(g.get('sample_goodput_vs_best'))}; in steps {_pct(g['goodput'])}): "
                         f"higher than 82 %: {verdict}")
    lines += ["", f"## Liveness: the longest pause (target <= lease TTL + 5 s = {PAUSE_TARGET_S:.0f} s)",
              "", f"The invariant: whenever at least {MIN_NODES} nodes had been in the job (live, "
              f"unfrozen) for over {LIVENESS_BOUND_S:.0f} s (lease TTL + restart bound), the job "
              "stepped (`elasticd/lab/chaos/liveness.py`).", ""]
    for system, g in summary.items():
        worst, owed = g.get("longest_pause_s"), g.get("liveness_violations")
        if worst is None and owed is None:
            continue
        verdict = "met" if worst is not None and worst <= PAUSE_TARGET_S else "**missed**"
        held = "held" if not owed else f"**violated** {len(owed)} time(s), first {owed[0]}"
        lines.append(f"- {SYSTEMS[system]}: longest pause {_f(worst, '{:.1f}')} s at "
                     f"+{_f(g.get('longest_pause_at_s'), '{:.1f}')} s (after: "
                     f"{'; '.join(g.get('longest_pause_after') or []) or 'no action'}): {verdict}; "
                     f"invariant {held}")
    lines += ["", "## The trace and each fault", "",
              "Times are seconds after the first step of the world of 4. recovery: from the signal to "
              "the first step in a world of another size; pause: from the old world's last step record "
              "to that step (progress records come at most every 0.25 s); lost: the old world's last "
              "step minus the step the new world continued from.", "",
              "| t s | kind | node | " + " | ".join(f"{SYSTEMS[x]}: recovery s / pause s / lost / path"
                                                   for x in summary) + " |",
              "|---|---|---|" + "---|" * len(summary)]
    events = {x: {(e["kind"], e["node"]): e for e in r["events"]}
              for r in report["runs"] if r["faulted"] and "events" in r for x in [r["system"]]}
    for fault in report["trace"]:
        cells = []
        for x in summary:
            e = events.get(x, {}).get((fault["kind"], fault["node"]))
            if e is None:
                cells.append("not sent")
            elif not e.get("recovered"):
                cells.append(e.get("note", "no new world"))
            else:
                cells.append(f"{e['recovery_s']:.2f} / {e['pause_s']:.2f} / {e['steps_lost']} / {e['path']}")
        lines.append(f"| {fault['t']:.1f} | {fault['kind']} | {fault['node']} | " + " | ".join(cells) + " |")
    lines += ["", *report.get("where", []), "", *_settings(report)]
    return "\n".join(lines) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def where_it_goes(summary: dict[str, dict[str, Any]]) -> list[str]:
    """The 'where the goodput goes' paragraph, from the figures."""
    out = ["## Where the goodput goes", ""]
    for system, g in summary.items():
        if not g["fault_free_steps"]:
            continue
        missing = g["fault_free_steps"] - g["useful_steps"]
        paused = g["paused_s"] * g["fault_free_rate"]
        rolled = g["steps_lost_total"]
        rest = missing - paused - rolled
        kinds = ", ".join(f"{k} {v['pause_s_median']:.1f} s" for k, v in g["by_kind"].items()
                          if v["pause_s_median"] is not None)
        out.append(
            f"- **{SYSTEMS[system]}**: {missing} steps short of fault-free. Pauses (no step for > 1 s: "
            f"detection, re-form or restart) total {g['paused_s']:.1f} s, ~{paused:.0f} steps at the "
            f"fault-free rate (median pause by kind: {kinds}); rollbacks to a checkpoint redid "
            f"{rolled} steps ({g['worker_restarts']} worker restarts, {g['inplace_reforms']} in-place "
            f"re-forms); the remaining ~{rest:.0f} steps are slower stepping between pauses (smaller "
            "worlds, restarts' short gaps under 1 s, load) and sampling.")
        if g.get("useful_rank_steps") is not None:
            small = g["useful_steps"] * NODES - g["useful_rank_steps"]
            out.append(
                f"  In samples: its {g['useful_steps']} steps were trained by {g.get('mean_world')} "
                f"nodes on average ({g['useful_rank_steps']} rank-steps); steps in worlds smaller than "
                f"{NODES} cost {small} rank-steps ({100 * small / (g['useful_steps'] * NODES or 1):.0f} % of "
                "what those steps would have trained at full size).")
    return out


def _settings(report: dict[str, Any]) -> list[str]:
    s, m = report["settings"], report["machine"]
    loads = [x for r in report["runs"] for x in r.get("load_1m_samples", [])]
    return ["## Settings", "",
            f"- Machine: {m['cpus']} CPU cores ({m['cpu_model']}), {m['mem_gib']} GiB, {m['platform']}; "
            f"Python {m['python']}, torch {m['torch']}, etcd {m['etcd']}. Load average (1 min) before "
            f"{report['load_before'][0]:.2f}, after {report.get('load_after', [0])[0]:.2f}, during the "
            f"traces median {_f(_median(loads))} (max {_f(max(loads, default=None))}).",
            f"- {NODES} nodes, min {MIN_NODES}, 1 CPU (gloo) worker each: `mlp.py {' '.join(TRAIN_ARGS)}`, "
            f"a checkpoint every {CHECKPOINT_EVERY} steps to a shared dir; trainer collective timeout 120 s.",
            f"- elasticd: `[recovery] mode = \"in-place\"`, lease TTL {LEASE_TTL_S} s, probe every 0.5 s, "
            "one etcd (never faulted).",
            f"- torchrun: `--rdzv-backend=c10d --rdzv-conf=is_host=0,{TUNED_CONF} --monitor-interval=0.1 "
            f"--nnodes={MIN_NODES}:{NODES} --max-restarts=1000 --local-addr=127.0.0.1`, "
            "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`; the c10d store is a separate `TCPStore` process that "
            "is never faulted (the fairest set-up: elasticd's etcd is not faulted either; with the store "
            "on a node's agent, as in `mttr.py`, that node's crash ends the job).",
            f"- Trace: seed {s['seed']}, MTBF {s['mtbf_s']:.0f} s (exponential), kinds from shuffled bags "
            f"{MIX}, victims at random; silent = SIGSTOP of the tree, SIGKILL {s['silent_s']:.0f} s later; "
            f"rejoin: a fresh node {s['rejoin_after_s']:.0f} s after one is gone; no fault in the first "
            f"{WARMUP_S:.0f} s nor the last {QUIET_TAIL_S:.0f} s; never below {MIN_NODES} nodes.",
            f"- Goodput: useful samples (the history held at the window's end, lowered to the step a "
            "rollback just after the end resumes from; each of its steps weighted by the world size it "
            "was trained in, from the progress records) / (the system's fault-free step rate, from a "
            f"fault-free run of {s['ref_s']:.0f} s of {NODES} nodes in this invocation, x {NODES} x the "
            "window). The window starts at the first step of the world of 4 (start-up is excluded for "
            "both). In steps: the same without the weights (a step of a smaller world counts as a "
            "step, though its global batch shrinks with the world).",
            ""]


def write_report(out: Path, name: str, report: dict[str, Any]) -> None:
    report["summary"] = summarize(report)
    report["where"] = where_it_goes(report["summary"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(report))


def across_seeds(reports: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """One row per (report, system): the liveness and goodput of each seed's trace, the
    verdicts against the longest-pause target and the invariant; JSON and markdown."""
    rows = []
    for report in reports:
        for system, g in summarize(report).items():
            rows.append({"seed": report["settings"]["seed"], "system": system,
                         "duration_s": report["settings"]["duration_s"], "survived": g["survived"],
                         "sample_goodput": g["sample_goodput"], "longest_pause_s": g["longest_pause_s"],
                         "longest_pause_at_s": g["longest_pause_at_s"],
                         "longest_pause_after": g["longest_pause_after"],
                         "violations": len(g["liveness_violations"] or []),
                         "pause_met": g["longest_pause_s"] is not None
                         and g["longest_pause_s"] <= PAUSE_TARGET_S})
    lines = [f"# Goodput and liveness across seeds (target: every trace survived, longest pause <= "
             f"{PAUSE_TARGET_S:.0f} s, invariant bound {LIVENESS_BOUND_S:.0f} s)", "",
             "| seed | system | trace s | survived | goodput, samples | longest pause s (at +s) | "
             "after | target | invariant |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        held = "held" if not r["violations"] else f"**violated** x{r['violations']}"
        lines.append(
            f"| {r['seed']} | {SYSTEMS[r['system']]} | {r['duration_s']:.0f} | "
            f"{'yes' if r['survived'] else '**no**'} | {_pct(r['sample_goodput'])} | "
            f"{_f(r['longest_pause_s'], '{:.1f}')} (+{_f(r['longest_pause_at_s'], '{:.0f}')}) | "
            f"{'; '.join(r['longest_pause_after']) or '-'} | {'met' if r['pause_met'] else '**missed**'} | "
            f"{held} |")
    return {"rows": rows}, "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=300.0, help="trace length per system")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--mtbf-s", type=float, default=60.0)
    p.add_argument("--silent-s", type=float, default=30.0, help="SIGSTOP this long, then SIGKILL")
    p.add_argument("--rejoin-after-s", type=float, default=20.0)
    p.add_argument("--ref-s", type=float, default=60.0, help="fault-free run per system")
    p.add_argument("--systems", default="elasticd,torchrun")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default="goodput")
    p.add_argument("--keep-dirs", action="store_true")
    p.add_argument("--from-json", type=Path, default=None,
                   help="re-derive the summary and markdown of a report already written (no run)")
    p.add_argument("--across", type=Path, nargs="+", default=None,
                   help="reports already written (one per seed): one liveness table of them all")
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="first wait up to this long for a quiet machine (1-min load < 0.8 for 30 s)")
    args = p.parse_args(argv)
    args.systems = [x for x in args.systems.split(",") if x]
    if bad := [x for x in args.systems if x not in SYSTEMS]:
        p.error(f"unknown system(s) {bad}; use {','.join(SYSTEMS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.across is not None:
        table, text = across_seeds([json.loads(path.read_text()) for path in args.across])
        (Path(args.out) / f"{args.name}.json").write_text(json.dumps(table, indent=1))
        (Path(args.out) / f"{args.name}.md").write_text(text)
        print(text)
        return 0
    if args.from_json is not None:
        report = rescore(json.loads(args.from_json.read_text()))
        write_report(Path(args.out), args.name, report)
        print((Path(args.out) / f"{args.name}.md").read_text())
        return 0
    proctree.become_subreaper()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    quiet = wait_quiet(args.wait_quiet_s) if args.wait_quiet_s > 0 else None
    trace = draw_trace(args.seed, args.duration_s, args.mtbf_s, rejoin_after_s=args.rejoin_after_s,
                       silent_s=args.silent_s)
    report: dict[str, Any] = {
        "argv": sys.argv[1:] if argv is None else argv,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "settings": {"duration_s": args.duration_s, "seed": args.seed, "mtbf_s": args.mtbf_s,
                     "silent_s": args.silent_s, "rejoin_after_s": args.rejoin_after_s, "ref_s": args.ref_s,
                     "nodes": NODES, "min_nodes": MIN_NODES, "mix": MIX, "tuned_rdzv_conf": TUNED_CONF,
                     "lease_ttl_s": LEASE_TTL_S, "checkpoint_every": CHECKPOINT_EVERY},
        "machine": machine(), "load_before": loadavg(), "quiet_wait": quiet,
        "trace": [asdict(f) for f in trace], "runs": []}
    print(f"trace: {[(f.t, f.kind, f.node) for f in trace]}", file=sys.stderr, flush=True)
    plan = [(x, []) for x in args.systems] + [(x, trace) for x in args.systems]
    try:
        for system, tr in plan:
            t = time.monotonic()
            run = run_system(system, tr, args.duration_s if tr else args.ref_s, args.silent_s,
                             keep=args.keep_dirs)
            if not tr:
                run["fault_free_rate"] = step_rate(run.get("timeline", []))
            report["runs"].append(run)
            print(f"{system} {'trace' if tr else 'fault-free'}: {run.get('outcome')}, useful "
                  f"{run.get('useful_steps')}, rate {run.get('fault_free_rate')} "
                  f"({time.monotonic() - t:.0f} s), leftover {run.get('leftover')}",
                  file=sys.stderr, flush=True)
            write_report(Path(args.out), args.name, report)
    except KeyboardInterrupt:
        report["interrupted"] = True
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        report["leftover_at_exit"] = kill_descendants()
        report["load_after"] = loadavg()
        write_report(Path(args.out), args.name, report)
    print((Path(args.out) / f"{args.name}.md").read_text())
    return 130 if report.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
