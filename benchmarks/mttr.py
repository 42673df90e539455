"""Mean time to recovery: plain torchrun (c10d, defaults and tuned) vs elasticd, side by side.

Systems (3 nodes on loopback, 1 CPU worker each, the same training script everywhere,
a shared checkpoint directory, one progress file per node):

    a  torchrun, c10d rendezvous hosted by node 0's agent (``is_host``), torch's defaults
       (``--nnodes=2:3 --max-restarts=100``, default monitor interval)
    b  the same, tuned: ``last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2``
       and ``--monitor-interval=0.1``
    c  elasticd, restart mode: 3 real daemons (``python -m elasticd run``; min 2, max 3 nodes,
       lease TTL 5 s, ``[recovery] mode = "restart"``) against a real etcd (``EmbeddedEtcd``):
       the survivors' workers are restarted by torchrun and resume from the checkpoint
    d  elasticd, in-place mode (``[recovery] mode = "in-place"``): the survivors keep their
       workers, which re-form the process group in the generation the daemons agree on

Scripts (``--script``; ``--extra SCRIPT:SYSTEMS:FAULTS`` adds cells of another one):

    mlp    ``trainer/examples/mlp.py --max-steps 1000000 --step-sleep 0.05``, a checkpoint
           every 20 steps
    heavy  ``trainer/examples/heavy.py`` with the same arguments plus ``--startup-delay-s 5``
           (a worker start costs 5 s more) and a 1 GiB frozen parameter in the checkpointed
           state; a checkpoint every 100 steps (a 1 GiB write takes ~3 s here)

Every torchrun agent runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and
``--local-addr=127.0.0.1`` (elasticd sets both for its own agents).

Faults, each on a freshly started cluster once the world of 3 has made a few steps:

    crash         SIGKILL a non-rank-0 node's whole tree at once (daemon, agent, workers),
                  captured with psutil before anything is signalled
    rank0-crash   the same for the rank-0 node; for c10d the node hosting the store
    silent        SIGSTOP a non-rank-0 node's whole tree (a frozen node)
    drain         SIGTERM to a non-rank-0 node's daemon (elasticd) or agent (torchrun)
    join          (elasticd) a crash as above; once the world of 2 has trained 8 s (settle + 2 s), a new
                  node n3 starts and the world grows back to 3 through a torchrun restart

Measures, per run:

* recovery time: from ``time.time()`` just before the signal to the ``time`` of the first
  completed step (``step`` or ``checkpoint`` event) in a world of 2 that a survivor's
  progress file shows; the files are polled every 20 ms;
* steps lost: the last step completed in the old world of 3 (the maximum over every node's
  progress, before the fault and while waiting: a drain keeps stepping until its coordinated
  stop) minus the step the new world continued from: on the restart path the step it
  resumed from (the survivors' ``resumed`` log line, a checkpoint), in place the step the
  survivors held when they re-formed (their ``reformed`` event's step; its next step is
  that step + 1). Which path a run took is in its ``path`` (restart, in-place, or
  fallback: a ``reform-failed`` before a restart);
* settle (elasticd): the new world is watched for 6 s after its first step; if its workers
  exit in that window (a restart after all), the run says when, and the steps that
  restart lost (its last step minus the step it resumed) count as lost too;
* drain: also the pause, from the drained node's workers' ``stopped`` line (they stop
  after the last step of the world of 3, which every rank completes) to the first step of
  the world of 2: the time the job does not train (until the stop it kept training, in
  place and by a coordinated stop alike);
* join: the pause, from the last completed step of the world of 2 to the first of the
  world of 3 (the time the job does not train), and the time from the new node's start;
  steps lost = the last step of the world of 2 minus the step the world of 3 resumed from;
* job lost: fewer than 2 survivors' root processes (agents, daemons) are still running;
* timeout: no step of the new world within the cap (a cell that times out says so);
* milestones (seconds after the fault, earliest survivor): the worker's collective error,
  the old worker's exit, the daemon's detection and eviction, the generation the daemons
  agreed (in place), the workers' ``reformed`` event (and its own ``duration_s``: from the
  failed collective to the new group), torch's "joined round", the new worker's start
  (psutil create time, calibrated against ``time.time()``), its process group, its
  ``resumed`` line and the first step. They say where the time goes.

Each cell is repeated ``--repeats`` times (systems interleaved within a repetition, so drift
of the machine hits all alike); the report gives the median and the range.
Every run kills whatever it started (SIGCONT, then SIGKILL of every descendant: this
process is the child subreaper) and removes its temp dir, also on Ctrl-C or SIGTERM.

    python benchmarks/mttr.py [--repeats N] [--systems a,b,c,d] [--script mlp|heavy]
                              [--faults crash,rank0-crash,silent,drain,join]
                              [--extra heavy:c,d:crash] [--out benchmarks/results] [--name mttr]

Writes ``NAME.json`` (every run, raw) and ``NAME.md`` (the tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from elasticd import proctree  # noqa: E402
from elasticd.lab.embedded_etcd import etcd_version, find_etcd_binary, free_port  # noqa: E402
from elasticd.lab.local_cluster import (  # noqa: E402
    MLP,
    REPO,
    TRAIN_ARGS,
    Cluster,
    Node,
    is_agent,
    kill_descendants,
    local_cluster,
    record_time,
    signal_all,
)

LEASE_TTL_S = 5
MIN_NODES, MAX_NODES = 2, 3
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
SYSTEMS = {"a": "torchrun c10d, defaults", "b": "torchrun c10d, tuned",
           "c": "elasticd, restart", "d": "elasticd, in-place"}
RECOVERY_MODE = {"c": "restart", "d": "in-place"}
FAULTS = {"crash": "node SIGKILL", "rank0-crash": "rank-0 node SIGKILL",
          "silent": "node SIGSTOP (silent)", "drain": "graceful drain (SIGTERM)",
          "join": "node joins (after a crash)",
          "spare": "node SIGKILL beside a warm spare (a fourth node, max_nodes 3)"}
JOIN_AFTER_S = 2.0   # how long the world of 2 trains before the new node starts
SETTLE_S = 6.0       # how long the new world is watched after its first step (does it hold?)


@dataclass(frozen=True)
class Script:
    """A training script and the checkpoint cadence it runs with."""

    path: str
    args: tuple[str, ...]
    checkpoint_every: int


SCRIPTS = {
    "mlp": Script(MLP, TRAIN_ARGS, 20),
    "heavy": Script(str(REPO / "trainer" / "examples" / "heavy.py"),
                    (*TRAIN_ARGS, "--startup-delay-s", "5", "--state-mb", "1024"), 100),
}
STEP_EVENTS = ("step", "checkpoint")
POLL_S = 0.02
RDZV_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] "
                       r"torch\.distributed\.elastic\.rendezvous\.dynamic_rendezvous: (.*)$")
MILESTONES = ("worker_error", "worker_stop", "old_worker_exit", "probe_refused", "peer_lost",
              "evicted", "generation_agreed", "reformed", "reform_failed", "in_place_fallback",
              "victim_exit", "joined_first", "new_worker_start", "joined_last", "pg_ready",
              "resumed", "first_step")
# First occurrence after the fault (JSON log lines of workers and daemons).
FIRST: dict[str, Callable[[str, dict], bool]] = {
    "worker_error": lambda e, r: e.startswith("collective failed"),
    "worker_stop": lambda e, r: e == "coordinated stop",
    "probe_refused": lambda e, r: "refused its liveness probe" in e,
    "peer_lost": lambda e, r: e.startswith("peer(s) ") and " lost" in e,
    # The daemon's cycle line names its EVICT's and SHRINK's outcomes in fields
    # (elasticd.actions.Outcome); the companion of plain torchrun logs its own recovery line.
    "evicted": lambda e, r: "evicted" in r,
    # The next generation agreed (written, or adopted: status ok).
    "generation_agreed": lambda e, r: r.get("generation_status") == "ok" or (
        r.get("event_kind") == "recovery" and r.get("status") == "ok"),
    "reform_failed": lambda e, r: e == "reform-failed",
    "in_place_fallback": lambda e, r: "in-place re-form fell back" in e,
}
# Milestones taken from the last survivor to reach them (the new world waits for all).
LATEST = ("joined_last", "new_worker_start", "pg_ready", "resumed", "reformed")
# Last occurrence before the new world's first step (the new world's size is the third argument).
LAST: dict[str, Callable[[str, dict, int], bool]] = {
    "pg_ready": lambda e, r, w: e == "process group ready" and r.get("world_size") == w,
    "resumed": lambda e, r, w: e == "resumed" and r.get("world_size") == w,
    "reformed": lambda e, r, w: e == "reformed" and r.get("world_size") == w,
}


# -- clusters (elasticd.lab.local_cluster builds, runs and cleans up the nodes) ---------------

@dataclass
class Bench:
    """One system's three nodes for one run, in the cluster that owns their processes."""

    system: str
    cluster: Cluster
    nodes: list[Node]
    script: Script
    job: str
    store_host: Node | None = None     # c10d: the agent that hosts the rendezvous store

    def add_daemon(self, name: str) -> Node:
        """Start one more elasticd node of this job (the join)."""
        node = self.cluster.daemon(
            name, self.job, min_nodes=MIN_NODES, max_nodes=MAX_NODES,
            entrypoint=[self.script.path, *self.script.args], lease_ttl_s=LEASE_TTL_S,
            every_steps=self.script.checkpoint_every,
            sections=f'[recovery]\nmode = "{RECOVERY_MODE[self.system]}"\n')
        self.nodes.append(node)
        return node


def make_bench(system: str, cluster: Cluster, script: Script) -> Bench:
    """Start the three nodes of ``system``; torchrun agents get elasticd's two agent fixes."""
    job = f"mttr-{system}-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
    if system in RECOVERY_MODE:
        bench = Bench(system, cluster, [], script, job)
        for i in range(MAX_NODES):
            bench.add_daemon(f"n{i}")
        return bench
    tuned = system == "b"
    port = free_port()
    nodes: list[Node] = [cluster.torchrun(
        f"n{i}", job, endpoint=f"127.0.0.1:{port}", backend="c10d", is_host=i == 0,
        rdzv_conf=TUNED_CONF if tuned else "", nnodes=f"{MIN_NODES}:{MAX_NODES}", max_restarts=100,
        monitor_interval_s=0.1 if tuned else None, script_path=script.path,
        script_args=script.args, every_steps=script.checkpoint_every,
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        for i in range(MAX_NODES)]
    return Bench(system, cluster, nodes, script, job, store_host=nodes[0])


# -- processes ---------------------------------------------------------------------------

def create_time_offset() -> float:
    """psutil's create_time minus time.time() at spawn (boot time is whole seconds)."""
    offsets = []
    for _ in range(3):
        before = time.time()
        proc = subprocess.Popen(["sleep", "0.1"])
        offsets.append(psutil.Process(proc.pid).create_time() - before)
        proc.wait()
    return statistics.median(offsets)


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# -- one run -----------------------------------------------------------------------------

def world_step(bench: Bench) -> int | None:
    """The step all 3 nodes have reached in a world of 3, or None if they are not all in it."""
    recs = [n.progress() for n in bench.nodes]
    if all(r and r.get("world_size") == MAX_NODES and r.get("event") in STEP_EVENTS for r in recs):
        return min(r["step"] for r in recs)
    return None


def wait_step(bench: Bench, target: int, deadline: float) -> int | None:
    """Wait (until the monotonic ``deadline``) for the world of 3 to reach ``target``;
    None at once when a node's root process has exited (it will not form)."""
    while time.monotonic() < deadline and all(n.alive() for n in bench.nodes):
        step = world_step(bench)
        if step is not None and step >= target:
            return step
        time.sleep(POLL_S)
    return None


def fault_step(formed_at: int, phase: int, every: int) -> int:
    """>= 10 steps after forming and past the first checkpoint, at ``phase`` in the cadence."""
    start = max(formed_at + 10, every + 1)
    return start + (phase - start) % every


def choose_victim(bench: Bench, fault: str) -> Node:
    """rank0-crash: the rank-0 node (c10d: the store host); otherwise a node that is neither."""
    ranks = {n.name: (n.progress() or {}).get("rank") for n in bench.nodes}
    if fault == "rank0-crash":
        return bench.store_host or next(n for n in bench.nodes if ranks[n.name] == 0)
    others = [n for n in bench.nodes if ranks[n.name] != 0 and n is not bench.store_host]
    return others[-1]


def inject(victim: Node, fault: str) -> float:
    """Send the fault; the wall time just before the signal."""
    if fault == "drain":
        now = time.time()
        victim.proc.send_signal(signal.SIGTERM)
        return now
    sig = signal.SIGSTOP if fault == "silent" else signal.SIGKILL   # join: a crash first
    tree = victim.tree()
    now = time.time()
    signal_all(tree, sig)
    return now


@dataclass
class Watch:
    """What the poll loop saw between the fault and the new world's first step."""

    t_fault: float
    old_step: int
    first: dict | None = None
    outcome: str = "timeout"
    old_worker_exit: float | None = None
    victim_exit: float | None = None
    survivors_exited: list[str] = field(default_factory=list)
    lost_after_s: float | None = None


def watch_recovery(bench: Bench, victim: Node, t_fault: float, old_step: int,
                   old_workers: list[psutil.Process], cap_s: float) -> Watch:
    w = Watch(t_fault, old_step)
    survivors = [n for n in bench.nodes if n is not victim]
    deadline = time.monotonic() + cap_s
    while time.monotonic() < deadline:
        _observe(w, bench.nodes, survivors, victim, old_workers)
        if w.first is not None:
            w.outcome = "recovered"
            return w
        w.survivors_exited = [n.name for n in survivors if not n.alive()]
        if len(survivors) - len(w.survivors_exited) < MIN_NODES:
            w.outcome = "job lost"
            w.lost_after_s = time.time() - t_fault
            return w
        time.sleep(POLL_S)
    return w


def _observe(w: Watch, nodes: list[Node], survivors: list[Node], victim: Node,
             old_workers: list[psutil.Process]) -> None:
    now = time.time()
    for node in nodes:
        rec = node.progress()
        if not rec:
            continue
        if rec.get("world_size") == MAX_NODES and rec.get("step") is not None:
            w.old_step = max(w.old_step, rec["step"])
        if (node in survivors and w.first is None and rec.get("world_size") == MAX_NODES - 1
                and rec.get("event") in STEP_EVENTS and rec.get("time", 0) > w.t_fault):
            w.first = dict(rec, node=node.name)
    if w.old_worker_exit is None and old_workers and not any(_running(p) for p in old_workers):
        w.old_worker_exit = now
    if w.victim_exit is None and not victim.alive():
        w.victim_exit = now


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_once(script: str, system: str, fault: str, phase: int, caps: dict[str, float],
             ct_offset: float, keep: bool) -> dict[str, Any]:
    """Start a cluster, wait for a world of 3, inject ``fault``, measure, tear down."""
    root = Path(tempfile.mkdtemp(prefix=f"mttr-{system}-{fault}-"))
    result: dict[str, Any] = {"script": script, "system": system, "fault": fault,
                              "row": row_key(fault, script), "load_start": loadavg()}
    cluster = None
    try:
        # The cluster kills every process it started on the way out, however it ends.
        with local_cluster(root, etcd=system in RECOVERY_MODE) as cluster:
            bench = make_bench(system, cluster, SCRIPTS[script])
            result |= measure(bench, fault, phase, caps, ct_offset)
    finally:
        finish_run(result, cluster, root, keep)
    return result


def finish_run(result: dict[str, Any], cluster: Any, root: Path, keep: bool) -> None:
    """A run's epilogue: what was left behind, the load at the end, its files kept or gone."""
    result["leftover"] = cluster.leftover if cluster else kill_descendants()
    result["load_end"] = loadavg()
    if keep:
        result["dir"] = str(root)
    else:
        shutil.rmtree(root, ignore_errors=True)


def measure(bench: Bench, fault: str, phase: int, caps: dict[str, float],
            ct_offset: float) -> dict[str, Any]:
    if fault in ("join", "spare") and bench.system not in RECOVERY_MODE:
        return {"outcome": "error", "error": f"{fault}: elasticd systems only"}
    deadline = time.monotonic() + caps["formation"]
    formed = wait_step(bench, 0, deadline)
    cpu_before = cpu_snapshot()
    every = bench.script.checkpoint_every
    if formed is None or wait_step(bench, fault_step(formed, phase, every), deadline) is None:
        dead = [n.name for n in bench.nodes if not n.alive()]
        return {"outcome": "setup timeout", "note": f"no world of 3 in time; exited: {dead}",
                "log_tail": {n.name: n.log_tail(1500) for n in bench.nodes if not n.alive()}}
    cpu = cpu_shares(cpu_before, cpu_snapshot())
    if fault == "spare":
        return measure_spare(bench, caps["default"], ct_offset) | {"cpu_cores_steady": cpu}
    victim = choose_victim(bench, fault)
    survivors = [n for n in bench.nodes if n is not victim]
    old_workers = [p for n in survivors for p in n.workers()]
    pre = max((n.progress() or {}).get("step", 0) for n in bench.nodes)
    victim_rank = (victim.progress() or {}).get("rank")
    load = loadavg()
    t_fault = inject(victim, fault)
    cap = caps["silent" if fault == "silent" and bench.system not in RECOVERY_MODE else "default"]
    w = watch_recovery(bench, victim, t_fault, pre, old_workers, cap)
    out = summarize_run(bench, victim, w, ct_offset) | {
        "victim": victim.name, "victim_rank": victim_rank, "victim_hosts_store": victim is bench.store_host,
        "step_before_fault": pre, "load_at_fault": load, "cap_s": cap, "cpu_cores_steady": cpu}
    if w.outcome != "recovered":
        return out
    survivors = [n for n in bench.nodes if n is not victim]
    out["settle"] = watch_settle(survivors, t_fault)
    if fault != "join":
        return out
    victim.kill()   # reaped: the new node is another machine
    shrink = {k: out.pop(k) for k in list(out) if k not in ("cap_s", "cpu_cores_steady")}
    return out | measure_join(bench, survivors, cap, ct_offset) | {"shrink": shrink}


def watch_settle(survivors: list[Node], t_fault: float) -> dict[str, Any]:
    """Watch the new world for ``SETTLE_S`` after its first step: do its workers hold?

    A world that is restarted soon after it formed (its workers exit) loses what it
    trained since the last checkpoint: those steps count as lost too (``steps_lost``).
    """
    workers = [p for n in survivors for p in _safe_workers(n)]
    t0, last, exited = time.time(), None, None
    until = time.monotonic() + SETTLE_S
    while time.monotonic() < until:
        if exited is None:
            for node in survivors:
                rec = node.progress()
                if rec and rec.get("event") in STEP_EVENTS and (last is None or rec["step"] > last):
                    last = rec["step"]
            if workers and not all(_running(p) for p in workers):
                exited = time.time()
        time.sleep(POLL_S)
    out: dict[str, Any] = {"window_s": SETTLE_S, "workers_exited_after_s": None, "steps_lost": 0}
    if exited is not None:
        resumed = last_event(survivors, "resumed", exited, time.time())
        cont = resumed[1].get("step") if resumed else None
        out |= {"workers_exited_after_s": round(exited - t_fault, 3), "last_step_before_exit": last,
                "resumed_step": cont, "steps_lost": last - cont if None not in (last, cont) else None}
    out["first_step_at"] = round(t0 - t_fault, 3)
    return out


SPARE_WAIT_S = 90.0   # how long the spare may take to be ready (warm, or waiting in the round)
SPARE_SETTLE_S = 3.0  # then this long (restart mode: its agent reaches the rendezvous)


def measure_spare(bench: Bench, cap: float, ct_offset: float) -> dict[str, Any]:
    """A fourth node starts beside the full world of 3 and is given time to be ready (in
    place: its workers warm, its daemon waiting as a spare; restart mode: its agent
    waiting for the next round); then a member that is not rank 0 is killed. Recovery:
    the kill to the first step of a world of 3 of another generation."""
    members = list(bench.nodes)
    spare = bench.add_daemon(f"n{MAX_NODES}")
    ready = time.monotonic() + SPARE_WAIT_S
    while time.monotonic() < ready and not _spare_ready(bench, spare):
        time.sleep(POLL_S)
    time.sleep(SPARE_SETTLE_S)
    victim = choose_victim(Bench(bench.system, bench.cluster, members, bench.script, bench.job), "crash")
    survivors = [n for n in bench.nodes if n is not victim]
    before = victim.progress() or {}
    old_gen, pre = before.get("generation"), max((n.progress() or {}).get("step", 0) for n in members)
    t_fault = inject(victim, "crash")
    w = Watch(t_fault, pre)
    deadline = time.monotonic() + cap
    while w.first is None and time.monotonic() < deadline:
        for node in survivors:
            rec = node.progress()
            if not rec or rec.get("event") not in STEP_EVENTS or rec.get("world_size") != MAX_NODES:
                continue
            if rec.get("generation") == old_gen:
                w.old_step = max(w.old_step, rec["step"])
            elif rec.get("time", 0) > t_fault:
                w.first, w.outcome = dict(rec, node=node.name), "recovered"
                break
        time.sleep(POLL_S)
    out = summarize_run(bench, victim, w, ct_offset) | {"victim": victim.name, "spare": spare.name,
                                                      "spare_ready": _spare_ready(bench, spare)}
    detected = out["milestones"].get("peer_lost")
    if w.first is not None and detected is not None:
        out["after_detection_s"] = round(out["recovery_s"] - detected, 3)
    return out


def _spare_ready(bench: Bench, spare: Node) -> bool:
    """In place: the spare's daemon says its workers wait warm as a spare; restart mode:
    its agent runs (it waits in the rendezvous for the next round)."""
    said = [e.get("event", "") for e in spare.daemon_events()]
    if RECOVERY_MODE[bench.system] == "in-place":
        return any("wait as a spare" in e for e in said)
    return any(e.startswith("starting the torchrun agent") for e in said)


def measure_join(bench: Bench, survivors: list[Node], cap: float, ct_offset: float) -> dict[str, Any]:
    """The world of 2 trains ``JOIN_AFTER_S``; a new node starts; wait for the world of 3."""
    last2: dict | None = None   # the newest completed step of the world of 2

    def track() -> None:
        nonlocal last2
        for node in survivors:
            rec = node.progress()
            if (rec and rec.get("world_size") == MAX_NODES - 1 and rec.get("event") in STEP_EVENTS
                    and (last2 is None or rec.get("time", 0) > last2.get("time", 0))):
                last2 = dict(rec, node=node.name)

    until = time.monotonic() + JOIN_AFTER_S
    while time.monotonic() < until:
        track()
        time.sleep(POLL_S)
    t_join = time.time()
    members = [*survivors, bench.add_daemon(f"n{MAX_NODES}")]
    first: dict | None = None
    deadline = time.monotonic() + cap
    while first is None and time.monotonic() < deadline:
        track()
        for node in members:
            rec = node.progress()
            if (rec and rec.get("world_size") == MAX_NODES and rec.get("event") in STEP_EVENTS
                    and rec.get("time", 0) > t_join):
                first = dict(rec, node=node.name)
                break
        time.sleep(POLL_S)
    if first is None or last2 is None:
        return {"outcome": "timeout", "note": "no world of 3 after the join"}
    t_end = first["time"] + 0.01
    per_node = {n.name: node_milestones(n, t_join, t_end, MAX_NODES) for n in members}
    marks = _merge_marks(per_node)
    marks |= {"first_step": first["time"] - t_join, "last_old_step": last2["time"] - t_join}
    starts = [p.create_time() - ct_offset for n in members for p in _safe_workers(n)]
    if starts := [t for t in starts if t > t_join]:
        marks["new_worker_start"] = max(starts) - t_join
    resumed = last_event(members, "resumed", t_join, t_end)
    # In place the step the world continues from is the members' re-form's.
    mark = resumed or last_event(survivors, "reformed", t_join, t_end)
    cont = mark[1].get("step") if mark else None
    # The progress file is rewritten at an interval, so its last step of the world of 2 can
    # be older than the step the survivors committed at the stop (it read 1 lost as -1).
    stopped = last_event(survivors, "stopped", t_join, t_end)
    last_step = max(last2["step"], stopped[1].get("step", -1) if stopped else -1)
    # In place (issue 26) nobody resumes a checkpoint: the members re-form, the newcomer
    # takes the state from a live peer.
    return {"outcome": "recovered", "path": "restart" if resumed else "in-place",
            "join_s": round(first["time"] - t_join, 3),
            "recovery_s": round(first["time"] - last2["time"], 3),
            "old_world_last_step": last_step, "continued_from": cont, "first_step": first["step"],
            "steps_lost": last_step - cont if cont is not None else None,
            "milestones_per_node": per_node,
            "milestones": {k: round(v, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])},
            "rendezvous_log": rendezvous_messages(members, t_join, t_end)}


def _role(proc: psutil.Process) -> str | None:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    joined = " ".join(cmd)
    if cmd and cmd[0].endswith("etcd"):
        return "etcd"
    if is_agent(cmd):
        return "agent"
    if "elasticd.warmstart" in joined and "--serve" in cmd:
        # The warm-start server, or a worker it forked: that keeps the server's command line.
        return "worker" if _forked_by_server(proc) else "daemon"
    if any(s.path in cmd for s in SCRIPTS.values()):
        return "worker"   # a cold worker, or a warm worker's (idle) client
    return "daemon" if "elasticd" in joined else None


def _forked_by_server(proc: psutil.Process) -> bool:
    try:
        parent = proc.parent()
        return parent is not None and "--serve" in parent.cmdline()
    except psutil.Error:
        return False


def cpu_snapshot() -> tuple[float, dict[int, tuple[str, float]]]:
    """(wall time, {pid: (role, cpu seconds)}) for every process this benchmark started."""
    out = {}
    for proc in proctree.descendants():
        role = _role(proc)
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            if role:
                out[proc.pid] = (role, times.user + times.system)
    return time.time(), out


def cpu_shares(before: tuple[float, dict], after: tuple[float, dict]) -> dict[str, float]:
    """CPU cores used per role (all nodes together) between two snapshots: the steady state."""
    wall = max(after[0] - before[0], 1e-6)
    shares: dict[str, float] = {}
    for pid, (role, cpu) in after[1].items():
        start = before[1].get(pid, (role, cpu))[1]
        shares[role] = shares.get(role, 0.0) + (cpu - start) / wall
    return {k: round(v, 3) for k, v in sorted(shares.items())} | {"window_s": round(wall, 2)}


def summarize_run(bench: Bench, victim: Node, w: Watch, ct_offset: float) -> dict[str, Any]:
    survivors = [n for n in bench.nodes if n is not victim]
    t_end = w.first["time"] + 0.01 if w.first else time.time()
    per_node = {n.name: node_milestones(n, w.t_fault, t_end) for n in survivors}
    path, cont, reform = continued_from(survivors, w.t_fault, t_end)
    if cont is None and w.first and w.first["step"] == 1:
        path, cont = "restart", 0  # no checkpoint yet: the new world started from scratch
    out: dict[str, Any] = {"outcome": w.outcome, "path": path, "old_world_last_step": w.old_step,
                           "continued_from": cont, "survivors_exited": w.survivors_exited,
                           "lost_after_s": round(w.lost_after_s, 3) if w.lost_after_s else None,
                           "milestones_per_node": per_node} | reform
    marks = _merge_marks(per_node) | _polled_marks(w, survivors, ct_offset)
    out["milestones"] = {k: round(v, 3) for k, v in sorted(marks.items(), key=lambda kv: kv[1])}
    if w.first:
        out["recovery_s"] = round(w.first["time"] - w.t_fault, 3)
        out["first_step"] = w.first["step"]
        out["steps_lost"] = w.old_step - cont if cont is not None else None
        stops = [t for r in victim.worker_events("stopped")
                 if (t := record_time(r)) is not None and w.t_fault < t <= w.first["time"]]
        if stops:   # a drain: the victim's workers stopped after the old world's last step
            out["pause_s"] = round(w.first["time"] - max(stops), 3)
    out["rendezvous_log"] = rendezvous_messages(bench.nodes, w.t_fault, t_end)
    return out


def _merge_marks(per_node: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each milestone's earliest node (the last one for those in LATEST)."""
    return {k: (max if k in LATEST else min)(d[k] for d in per_node.values() if k in d)
            for k in MILESTONES if any(k in d for d in per_node.values())}


def continued_from(survivors: list[Node], t_fault: float, t_end: float
                   ) -> tuple[str | None, int | None, dict[str, Any]]:
    """(path, the step the new world continued from, the re-form's details).

    The latest of the survivors' ``resumed`` (restart: the checkpoint's step) and
    ``reformed`` (in place: the step the survivors held, their next step is that + 1)
    before the first step; a restart after a ``reform-failed`` is a fallback.
    """
    resumed = last_event(survivors, "resumed", t_fault, t_end)
    reformed = last_event(survivors, "reformed", t_fault, t_end)
    failed = last_event(survivors, "reform-failed", t_fault, t_end)
    details: dict[str, Any] = {}
    if reformed:
        durations = [r.get("duration_s") for n in survivors for r in n.worker_events("reformed")
                     if t_fault < (record_time(r) or 0) <= t_end and r.get("duration_s") is not None]
        rec = reformed[1]
        details["reform"] = {"duration_s_max": max(durations, default=None), "durations_s": durations,
                             "cause": rec.get("cause"), "generation": rec.get("generation"),
                             "lost": rec.get("lost"), "from_world_size": rec.get("from_world_size")}
    if failed:
        details["reform_failed"] = {"reason": failed[1].get("reason"),
                                    "duration_s": failed[1].get("duration_s")}
    if resumed and (not reformed or resumed[0] > reformed[0]):
        return ("fallback" if failed or reformed else "restart"), resumed[1].get("step"), details
    if reformed:
        return "in-place", reformed[1].get("step"), details
    return None, None, details


def _polled_marks(w: Watch, survivors: list[Node], ct_offset: float) -> dict[str, float]:
    marks = {}
    if w.old_worker_exit is not None:
        marks["old_worker_exit"] = w.old_worker_exit - w.t_fault
    if w.victim_exit is not None:
        marks["victim_exit"] = w.victim_exit - w.t_fault
    if w.first is not None:
        marks["first_step"] = w.first["time"] - w.t_fault
        starts = [p.create_time() - ct_offset for n in survivors for p in _safe_workers(n)]
        starts = [t for t in starts if t > w.t_fault]
        if starts:
            marks["new_worker_start"] = max(starts) - w.t_fault
    return marks


def _safe_workers(node: Node) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return node.workers()
    return []


# -- logs --------------------------------------------------------------------------------

def node_milestones(node: Node, t_fault: float, t_end: float, world: int = MAX_NODES - 1
                    ) -> dict[str, float]:
    """Seconds after the fault of this node's logged milestones (see FIRST and LAST);
    ``world``: the new world's size."""
    out: dict[str, float] = {}
    for rec in node.log_events():
        t = record_time(rec)
        if t is None or not t_fault < t <= t_end:
            continue
        event = rec["event"]
        for key, pred in FIRST.items():
            if pred(event, rec):
                out[key] = min(out.get(key, t), t)
        for key, pred in LAST.items():
            if pred(event, rec, world):
                out[key] = max(out.get(key, t), t)
    for t, msg in rdzv_lines(node):
        if t_fault < t <= t_end and "has joined round" in msg:
            out["joined_first"] = min(out.get("joined_first", t), t)
            out["joined_last"] = max(out.get("joined_last", t), t)
    return {k: v - t_fault for k, v in out.items()}


def rdzv_lines(node: Node) -> Iterator[tuple[float, str]]:
    """torch's dynamic_rendezvous lines (elasticd's agents make them visible)."""
    for path in node.logs():
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            m = RDZV_LINE.match(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                yield t, m.group(2)


def rendezvous_messages(nodes: list[Node], t_fault: float, t_end: float) -> list[str]:
    """torch's rendezvous lines between the fault and the first step (for the oddities)."""
    out = []
    for node in nodes:
        out += [(t, f"{node.name} +{t - t_fault:.2f}s {msg[:200]}") for t, msg in rdzv_lines(node)
                if t_fault < t <= t_end]
    return [m for _, m in sorted(out)][:30]


def last_event(nodes: list[Node], event: str, t0: float, t_end: float) -> tuple[float, dict] | None:
    """(time, record) of the nodes' workers' last ``event`` line in (t0, t_end]."""
    best: tuple[float, dict] | None = None
    for node in nodes:
        for rec in node.worker_events(event):
            t = record_time(rec)
            if t is not None and t0 < t <= t_end and (best is None or t > best[0]):
                best = (t, rec)
    return best


# -- summary and report ------------------------------------------------------------------

def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "n": len(values)}


def row_key(fault: str, script: str) -> str:
    """A table row: the fault, with the script where it is not the default one."""
    return fault if script == "mlp" else f"{fault}@{script}"


def row_label(row: str) -> str:
    fault, _, script = row.partition("@")
    return FAULTS[fault] + (f", {script} script" if script else "")


def summarize_cells(runs: list[dict]) -> dict[str, dict[str, dict]]:
    cells: dict[str, dict[str, dict]] = {}
    for run in runs:
        row = run.get("row", run["fault"])
        cells.setdefault(row, {}).setdefault(run["system"], {"runs": []})["runs"].append(run)
    for by_system in cells.values():
        for cell in by_system.values():
            rs = cell.pop("runs")
            ok = [r for r in rs if r.get("outcome") == "recovered"]
            cell["n"] = len(rs)
            cell["outcomes"] = {o: sum(r.get("outcome") == o for r in rs) for o in
                                sorted({r.get("outcome", "error") for r in rs})}
            cell["recovery_s"] = _stats([r["recovery_s"] for r in ok])
            cell["recovery_all_s"] = [r["recovery_s"] for r in ok]
            cell["steps_lost"] = _stats([r["steps_lost"] for r in ok if r.get("steps_lost") is not None])
            cell["steps_lost_all"] = [r.get("steps_lost") for r in ok]
            cell["paths"] = {p: sum(r.get("path") == p for r in ok)
                             for p in sorted({str(r.get("path")) for r in ok})}
            cell["reform_s"] = _stats([r["reform"]["duration_s_max"] for r in ok
                                       if (r.get("reform") or {}).get("duration_s_max") is not None])
            cell["join_s"] = _stats([r["join_s"] for r in ok if "join_s" in r])
            cell["after_detection_s"] = _stats([r["after_detection_s"] for r in ok
                                                if "after_detection_s" in r])
            cell["pause_s"] = _stats([r["pause_s"] for r in ok if "pause_s" in r])
            cell["pause_all_s"] = [r["pause_s"] for r in ok if "pause_s" in r]
            settled = [r.get("settle") or (r.get("shrink") or {}).get("settle") for r in ok]
            cell["settle_exits_s"] = [x["workers_exited_after_s"] for x in settled
                                      if x and x["workers_exited_after_s"] is not None]
            cell["settle_steps_lost"] = [x.get("steps_lost") for x in settled
                                         if x and x["workers_exited_after_s"] is not None]
            cell["milestones"] = {k: _stats([r["milestones"][k] for r in ok if k in r.get("milestones", {})])
                                  for k in ("last_old_step", *MILESTONES)}
            cell["milestones"] = {k: v["median"] for k, v in cell["milestones"].items() if v}
            cell["cap_s"] = max((r.get("cap_s", 0) for r in rs), default=0)
            cell["job_lost_after_s"] = _stats([r["lost_after_s"] for r in rs if r.get("lost_after_s")])
    return cells


def cell_text(cell: dict) -> str:
    parts = []
    rec, lost, n = cell["recovery_s"], cell["steps_lost"], cell["n"]
    if rec:
        share = "" if rec["n"] == n else f" [{rec['n']}/{n} runs]"
        parts.append(f"{rec['median']:.2f} s ({rec['min']:.2f}–{rec['max']:.2f}){share}")
        if lost:
            span = "" if lost["min"] == lost["max"] else f" ({lost['min']:.0f}–{lost['max']:.0f})"
            parts.append(f"{lost['median']:.0f}{span} steps lost")
        pause = cell.get("pause_s")
        if pause:
            parts.append(f"pause {pause['median']:.2f} s ({pause['min']:.2f}–{pause['max']:.2f})")
        if cell.get("settle_exits_s"):
            parts.append(f"**then restarted by itself** at {cell['settle_exits_s']} s after the fault "
                         f"[{len(cell['settle_exits_s'])}/{n} runs; steps lost then "
                         f"{cell['settle_steps_lost']}]")
        paths = {p: c for p, c in cell.get("paths", {}).items() if p != "None"}
        if len(paths) > 1 or "fallback" in paths:
            parts.append("paths " + ", ".join(f"{p} {c}" for p, c in paths.items()))
    for outcome, count in cell["outcomes"].items():
        if outcome == "recovered":
            continue
        label = {"timeout": f"> {cell['cap_s']:.0f} s cap, not recovered"}.get(outcome, outcome)
        lost = cell["job_lost_after_s"]
        if outcome == "job lost" and lost:
            label += f" (survivors' agents exited after {lost['median']:.1f} s)"
        parts.append(f"{label} [{count}/{n} runs]")
    return ", ".join(parts)


def markdown(report: dict) -> str:
    systems, rows = report["settings"]["systems"], report["settings"]["rows"]
    lines = ["# Recovery time (MTTR): plain torchrun vs elasticd (restart and in place)", "",
             "| fault | " + " | ".join(SYSTEMS[s] for s in systems) + " |",
             "|---|" + "---|" * len(systems)]
    for row in rows:
        cells = report["cells"].get(row, {})
        lines.append(f"| {row_label(row)} | " + " | ".join(
            cell_text(cells[s]) if s in cells else "–" for s in systems) + " |")
    lines += ["", "Cells: median recovery time (min–max) over the recovered runs, from the signal "
              "to the first completed step of the new world of 2 (join: the pause, from the last "
              "step of the world of 2 to the first of the world of 3); steps lost: last step of the "
              "old world minus the step the new world continued from (restart: the checkpoint it "
              "resumed; in place: the step the survivors held at the re-form); drain's pause: from "
              "the drained node's workers' stop, after the old world's last step, to the new "
              "world's first step (the time the job does not train).", ""]
    lines += _targets(report)
    lines += _milestone_table(report, systems, rows)
    lines += _cpu_table(report, systems)
    lines += _notes(report)
    return "\n".join(lines) + "\n"


def _milestone_table(report: dict, systems: list[str], rows: list[str]) -> list[str]:
    cells = [(row, system, report["cells"].get(row, {}).get(system)) for row in rows
             for system in systems]
    cells = [(r, s, c) for r, s, c in cells if c and c["milestones"]]
    used = [k for k in ("last_old_step", *MILESTONES) if any(k in c["milestones"] for _, _, c in cells)]
    lines = ["## Where the time goes (median seconds after the fault; join: after the new node's start)",
             "", "| fault | system | " + " | ".join(used) + " | reform duration_s |",
             "|---|---|" + "---|" * (len(used) + 1)]
    for row, system, cell in cells:
        ms, reform = cell["milestones"], cell.get("reform_s")
        lines.append(f"| {row} | {system} | " + " | ".join(
            f"{ms[k]:.2f}" if k in ms else "" for k in used) + " | "
            + (f"{reform['median']:.3f} ({reform['min']:.3f}–{reform['max']:.3f})" if reform else "")
            + " |")
    return [*lines, "", "Milestones (earliest survivor, except joined_last, new_worker_start, pg_ready, "
            "resumed and reformed: the last survivor, which the new world waits for): "
            "worker_error = a survivor's worker logs the failed collective; "
            "worker_stop = coordinated stop (drain); old_worker_exit = the survivors' old workers are "
            "gone; probe_refused / peer_lost / evicted = elasticd daemon log (peer_lost: the loss "
            "decision); generation_agreed = the daemon's sentence that the next generation is agreed "
            "(or adopted) and the workers re-form in place; reformed = the workers' `reformed` event; "
            "reform_failed / in_place_fallback = the worker's and the daemon's fallback to a restart; "
            "victim_exit = the drained node's root process exited; joined_first/last = torch's "
            "\"joined round\" (elasticd's agents only; torch logs it nowhere by default); "
            "new_worker_start = psutil create time of the new worker; pg_ready = \"process group "
            "ready\" in the new world; resumed = the checkpoint loaded; first_step = first step of the "
            "new world; last_old_step (join) = the last step of the world of 2. reform duration_s = "
            "the worker's own measure of its re-form (failed collective -> new group, state agreed; "
            "the slowest survivor), median (min–max).", ""]


# The targets: (row, system, limit in seconds, wording).
TARGETS = (
    ("crash", "d", 1.0, "in place: node crash <= 1 s"),
    ("rank0-crash", "d", 1.0, "in place: rank-0 node crash <= 1 s"),
    ("silent", "d", LEASE_TTL_S + 1.0, f"in place: silent node <= lease TTL + 1 s = {LEASE_TTL_S + 1} s"),
    ("crash", "c", 3.0, "restart path (restart mode): node crash <= 3 s"),
    ("rank0-crash", "c", 3.0, "restart path (restart mode): rank-0 node crash <= 3 s"),
    # A join in place (issue 26): 0.2 s plus the state's bytes over the link, here a few kB
    # over loopback (the pause includes one step of the world of 2, ~0.03-0.05 s).
    ("join", "d", 0.2, "in place: the members' pause for a join <= 0.2 s (+ the state's bytes / "
                       "the link's bandwidth: a few kB here)"),
    ("join", "c", 3.0, "restart path: join after a restart-mode shrink (the pause) <= 3 s"),
)
# A warm spare replaces a crashed node within the crash's detection + this (issue 26).
SPARE_AFTER_DETECTION_S = 0.2
# A newcomer contributes (its first step) this soon after its daemon starts (issue 26).
JOINER_TARGET_S = 3.0
# A drain in place (issue 26): the pause it costs the others, median.
DRAIN_PAUSE_TARGET_S = 0.5
# In-place figures must not grow with the heavy script: allowed growth of the median.
HEAVY_SLACK_S = 0.25


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _targets(report: dict) -> list[str]:
    cells = report["cells"]
    lines = ["## Targets", ""]
    for row, system, limit, text in TARGETS:
        cell = cells.get(row, {}).get(system)
        if not cell:
            continue
        rec = cell["recovery_s"]
        if rec is None:
            lines.append(f"- {text}: not recovered in any run: **missed**")
            continue
        lines.append(f"- {text}: median {rec['median']:.2f} s (range {rec['min']:.2f}–{rec['max']:.2f}, "
                     f"{rec['n']}/{cell['n']} runs recovered): {_verdict(rec['median'] <= limit)}")
    for row, by_system in cells.items():
        cell = by_system.get("d")
        if cell and cell["steps_lost_all"]:
            lost = cell["steps_lost_all"]
            later = cell.get("settle_steps_lost", [])
            # Below 0: the old world's last step seen in its (rate-limited) progress file is
            # behind the step the new world continued from; nothing seen was lost.
            ok = all(x is not None and x <= 0 for x in lost) and all(x == 0 for x in later)
            lines.append(f"- in place: 0 steps lost (<= 0: the progress file's lag), {row}: {lost}"
                         + (f", then {later} when the new world was restarted" if later else "")
                         + f": {_verdict(ok)}")
    drain = cells.get("drain", {}).get("d")
    if drain and drain.get("pause_s"):
        lines.append(_median_line(f"in place: a drain pauses the others <= {DRAIN_PAUSE_TARGET_S} s",
                                  drain["pause_s"], DRAIN_PAUSE_TARGET_S))
    join = cells.get("join", {}).get("d")
    if join and join.get("join_s"):
        lines.append(_median_line(f"in place: a newcomer steps <= {JOINER_TARGET_S} s after its "
                                  "daemon starts", join["join_s"], JOINER_TARGET_S))
    spare = cells.get("spare", {}).get("d")
    if spare and spare.get("after_detection_s"):
        lines.append(_median_line(f"in place: a warm spare replaces a crashed node <= the detection + "
                                  f"{SPARE_AFTER_DETECTION_S} s (kill to the first step of the new "
                                  "world of 3, less the survivors' detection)",
                                  spare["after_detection_s"], SPARE_AFTER_DETECTION_S))
    for row in [r for r in cells if r.endswith("@heavy")]:
        light, heavy = cells.get(row.split("@")[0], {}).get("d"), cells[row].get("d")
        if light and heavy and light["recovery_s"] and heavy["recovery_s"]:
            a, b = light["recovery_s"]["median"], heavy["recovery_s"]["median"]
            lines.append(f"- in place does not grow with the heavy script, {row.split('@')[0]}: "
                         f"mlp {a:.2f} s, heavy {b:.2f} s (allowed +{HEAVY_SLACK_S} s): "
                         f"{_verdict(b <= a + HEAVY_SLACK_S)}")
    return [*lines, ""] if len(lines) > 2 else []


def _median_line(text: str, stats: dict[str, Any], limit: float) -> str:
    """One target's line: its median against ``limit``, with the range and run count."""
    return (f"- {text}: median {stats['median']:.2f} s (range {stats['min']:.2f}–{stats['max']:.2f}, "
            f"{stats['n']} runs): {_verdict(stats['median'] <= limit)}")


def cpu_by_system(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Median steady-state CPU cores per role, per system, over every run."""
    out: dict[str, dict[str, float]] = {}
    for system in sorted({r["system"] for r in runs}):
        samples = [r["cpu_cores_steady"] for r in runs if r["system"] == system and "cpu_cores_steady" in r]
        roles = sorted({k for s in samples for k in s if k != "window_s"})
        out[system] = {k: round(statistics.median(s.get(k, 0.0) for s in samples), 2) for k in roles}
    return out


def _cpu_table(report: dict, systems: list[str]) -> list[str]:
    cpu = report.get("cpu_cores_steady", {})
    roles = ["worker", "agent", "daemon", "etcd"]
    lines = ["## Steady-state CPU before the fault (cores, 3 nodes together, median over runs)", "",
             "| system | " + " | ".join(roles) + " |", "|---|" + "---|" * len(roles)]
    for system in systems:
        if system in cpu:
            lines.append(f"| {SYSTEMS[system]} | " + " | ".join(
                f"{cpu[system][r]:.2f}" if r in cpu[system] else "–" for r in roles) + " |")
    return [*lines, ""]


def _notes(report: dict) -> list[str]:
    m, s = report["machine"], report["settings"]
    quiet = report.get("quiet_wait", {})
    faults = report.get("load_at_faults") or {}
    after = report.get("load_after") or loadavg()   # (a report written between runs: now)
    load_line = (f"Load average (1 min) before {report['load_before'][0]:.2f}, after "
                 f"{after[0]:.2f}, at the faults median {faults.get('median', 0):.2f} "
                 f"(max {faults.get('max', 0):.2f}).")
    if quiet and not quiet.get("quiet", True):
        load_line += (" **The machine never got quiet (1-min load < 0.8 for 30 s) within "
                      f"{quiet['limit_s']:.0f} s; other test suites were running, which inflates every "
                      "time here.**")
    return ["## Settings", "",
            f"- Machine: {m['cpus']} CPU cores ({m['cpu_model']}), {m['mem_gib']} GiB, {m['platform']}; "
            f"Python {m['python']}, torch {m['torch']}, etcd {m['etcd']}. {load_line}",
            f"- {s['repeats']} repetition(s) per cell; recovery capped at {s['cap_s']:.0f} s "
            f"(SIGSTOP on torchrun: {s['silent_cap_s']:.0f} s); poll every {POLL_S * 1000:.0f} ms.",
            f"- Workload: `{' '.join(['mlp.py', *TRAIN_ARGS])}`, 1 CPU (gloo) worker per node, 3 nodes, "
            f"checkpoint every {SCRIPTS['mlp'].checkpoint_every} steps to a shared dir (rank 0 writes), "
            "trainer collective timeout 120 s (`--collective-timeout-s` default, passed to gloo). "
            f"Heavy script: `heavy.py {' '.join(SCRIPTS['heavy'].args)}` (a 1 GiB frozen parameter "
            "in every checkpoint, broadcast once by DDP at start; 5 s sleep before the model is "
            f"built), checkpoint every {SCRIPTS['heavy'].checkpoint_every} steps.",
            "- torchrun: `--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --rdzv-conf=is_host=1|0` "
            "(node n0's agent hosts the store), `--nnodes=2:3 --max-restarts=100 --local-addr=127.0.0.1`, "
            "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` for every agent (in a and b too). "
            "(a) defaults: last_call 30 s, keep-alive 5 s x 3, monitor interval default "
            "(0.1 s in torch 2.13, so a and b differ only in the rdzv-conf). "
            f"(b) tuned: `--rdzv-conf={TUNED_CONF}` `--monitor-interval=0.1` "
            "(DESIGN.md warns that 1 s x 2 self-evicts and can split the world).",
            f"- elasticd: 3 daemons, min 2 / max 3 nodes, lease TTL {LEASE_TTL_S} s, probe every 0.5 s, "
            "rendezvous etcd3 with last_call 1 s, keep-alive 1 s x 5, monitor interval 0.1 s; "
            "(c) `[recovery] mode = \"restart\"`, (d) `mode = \"in-place\"` (default bound_s and "
            "store_port). Join: the crash of a non-rank-0 node, then, once the world of 2 has "
            f"trained {SETTLE_S + JOIN_AFTER_S:.0f} s (the settle watch, then {JOIN_AFTER_S:.0f} s), "
            "a new node n3 starts.",
            "- Faults are injected once the world of 3 has made >= 10 steps, at a step whose offset in "
            "the 20-step checkpoint cadence is drawn at random (seeded), so steps lost sample the "
            "cadence. rank-0 node on c10d = the store host (n0).",
            "- SIGSTOP on torchrun: the survivors block in the gradient all-reduce until the gloo "
            "timeout, which is the trainer's 120 s (not gloo's 30 min default), so the 90 s cap "
            "expires first; with a plain script that leaves gloo's default it would be 30 min.",
            ""]


def machine() -> dict[str, Any]:
    import torch

    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?")
    return {"cpus": os.cpu_count(), "cpu_model": model,
            "mem_gib": round(psutil.virtual_memory().total / 2**30), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "etcd": etcd_version(find_etcd_binary())}


def wait_quiet(limit_s: float, threshold: float = 0.8, every_s: float = 30.0) -> dict[str, Any]:
    """Wait until the 1-min load stays under ``threshold`` for two readings ``every_s`` apart."""
    start = time.monotonic()
    samples = [loadavg()[0]]
    while time.monotonic() - start < limit_s:
        if len(samples) >= 2 and samples[-1] < threshold and samples[-2] < threshold:
            return {"quiet": True, "waited_s": round(time.monotonic() - start), "samples": samples,
                    "limit_s": limit_s}
        time.sleep(every_s)
        samples.append(loadavg()[0])
        print(f"load {samples[-1]:.2f}", file=sys.stderr, flush=True)
    quiet = len(samples) >= 2 and samples[-1] < threshold and samples[-2] < threshold
    return {"quiet": quiet, "waited_s": round(time.monotonic() - start), "samples": samples,
            "limit_s": limit_s}


# -- main --------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default="a,b,c,d", help="a: torchrun defaults, b: torchrun tuned, "
                   "c: elasticd restart mode, d: elasticd in-place mode")
    p.add_argument("--faults", default="crash,rank0-crash,silent,drain", help=f"any of {','.join(FAULTS)}")
    p.add_argument("--script", default="mlp", choices=sorted(SCRIPTS))
    p.add_argument("--extra", action="append", default=[], metavar="SCRIPT:SYSTEMS:FAULTS",
                   help="more cells in each repetition, e.g. heavy:c,d:crash,rank0-crash (repeatable)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default="mttr", help="the reports' base name: NAME.json, NAME.md")
    p.add_argument("--cap-s", type=float, default=120.0, help="recovery cap per run")
    p.add_argument("--silent-cap-s", type=float, default=90.0, help="cap for SIGSTOP on torchrun")
    p.add_argument("--formation-timeout-s", type=float, default=240.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="first wait up to this long for a quiet machine (1-min load < 0.8 for 30 s)")
    p.add_argument("--keep-dirs", action="store_true", help="keep each run's logs (paths in the JSON)")
    args = p.parse_args(argv)
    groups = [(args.script, args.systems, args.faults)]
    for spec in args.extra:
        script, _, rest = spec.partition(":")
        systems, _, faults = rest.partition(":")
        groups.append((script, systems, faults))
    args.groups = [(script, [s for s in systems.split(",") if s], [f for f in faults.split(",") if f])
                   for script, systems, faults in groups]
    bad = [x for script, systems, faults in args.groups
           for x in ([script] if script not in SCRIPTS else [])
           + [s for s in systems if s not in SYSTEMS] + [f for f in faults if f not in FAULTS]]
    if bad:
        p.error(f"unknown script(s)/system(s)/fault(s): {bad}")
    args.systems = [s for s in SYSTEMS if any(s in g[1] for g in args.groups)]
    args.rows = list(dict.fromkeys(row_key(f, script) for script, _, faults in args.groups
                                   for f in faults))
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(script, system, fault, phase) in run order: repetition, then group and fault, then system."""
    rng = random.Random(args.seed)
    return [(script, s, f, rng.randrange(SCRIPTS[script].checkpoint_every))
            for _ in range(args.repeats) for script, systems, faults in args.groups
            for f in faults for s in systems]


def build_report(args: argparse.Namespace, runs: list[dict], extra: dict[str, Any]) -> dict[str, Any]:
    at_fault = [r["load_at_fault"][0] for r in runs if "load_at_fault" in r]
    return {"settings": {"repeats": args.repeats, "systems": args.systems, "rows": args.rows,
                         "groups": args.groups, "cap_s": args.cap_s, "silent_cap_s": args.silent_cap_s,
                         "seed": args.seed, "poll_s": POLL_S, "lease_ttl_s": LEASE_TTL_S,
                         "scripts": {k: [v.path, *v.args, f"checkpoint every {v.checkpoint_every}"]
                                     for k, v in SCRIPTS.items()},
                         "join_after_s": JOIN_AFTER_S, "tuned_rdzv_conf": TUNED_CONF},
            **extra, "load_at_faults": _stats(at_fault), "cells": summarize_cells(runs),
            "cpu_cores_steady": cpu_by_system(runs), "runs": runs}


def write_report(out: Path, name: str, report: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown(report))


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def execute(args: argparse.Namespace, runs: list[dict], extra: dict[str, Any]) -> None:
    caps = {"default": args.cap_s, "silent": args.silent_cap_s, "formation": args.formation_timeout_s}
    offset = create_time_offset()
    for i, (script, system, fault, phase) in enumerate(plan(args), 1):
        t0 = time.monotonic()
        try:
            run = run_once(script, system, fault, phase, caps, offset, args.keep_dirs)
        except Exception as exc:  # noqa: BLE001 - one broken run must not end the benchmark
            run = {"script": script, "system": system, "fault": fault, "row": row_key(fault, script),
                   "outcome": "error", "error": repr(exc)}
        runs.append(run)
        print(f"[{i}] {SYSTEMS[system]:20s} {row_key(fault, script):18s} {run.get('outcome')}: "
              f"{run.get('recovery_s', run.get('lost_after_s', '-'))} s, lost {run.get('steps_lost', '-')}, "
              f"path {run.get('path')} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        # Written after every run: an interrupted benchmark keeps what it measured.
        write_report(Path(args.out), args.name, build_report(args, runs, extra))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proctree.become_subreaper()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    extra: dict[str, Any] = {"machine": machine()}
    if args.wait_quiet_s > 0:
        extra["quiet_wait"] = wait_quiet(args.wait_quiet_s)
    extra["load_before"] = loadavg()
    runs: list[dict] = []
    try:
        execute(args, runs, extra)
    except KeyboardInterrupt:
        extra["interrupted"] = True
        print("interrupted; cleaning up", file=sys.stderr)
    finally:
        extra["leftover_at_exit"] = kill_descendants()
        extra["load_after"] = loadavg()
        write_report(Path(args.out), args.name, build_report(args, runs, extra))
    print((Path(args.out) / f"{args.name}.md").read_text())
    return 130 if extra.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
