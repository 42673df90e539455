"""Fault injectors: one class per fault, each with ``inject`` and ``heal``, and the registry.

An injector acts on a live local cluster (``Target``: the cluster's nodes, its etcd and
checkpoint directory) and returns what it did, for the report. ``inject`` is the fault
itself; ``heal`` brings the victim back (restarts a killed node, continues a stopped one)
or does nothing where the system must recover on its own (a killed worker, agent or
checkpoint writer). Every injector only signals processes of the cluster it was given
(its nodes, its etcd members), edits files under its root or tells the cluster's own fake
metadata servers what to announce: nothing outside the test's own tree is touched. The
etcd-cluster, cloud and machine faults are in ``cluster_faults.py``.

Process roles inside one node's tree (``python -m elasticd run`` at the root):

* the **agent**: ``python -m torch.distributed.run ...``;
* the **warm server**: ``python -m elasticd.warmstart --serve ...`` (the daemon's child),
  whose forked children are the real workers when warm starts are on;
* a **client**: ``python -m elasticd.warmstart SOCKET SCRIPT ...``, torchrun's idea of a
  worker (it mirrors the forked one), or, cold, the script itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil

from checkpointing import layout
from checkpointing.errors import CorruptCheckpointError
from checkpointing.manifest import Manifest
from elasticd import proctree
from elasticd.lab.embedded_etcd import EmbeddedEtcd, EmbeddedEtcdCluster
from elasticd.lab.fake_metadata import FakeMetadata
from elasticd.lab.local_cluster import DaemonNode, is_agent

Detail = dict[str, Any]


class InjectionError(RuntimeError):
    """The fault could not be injected as asked (no such process, no checkpoint yet ...)."""


@dataclass
class Target:
    """What injectors act on: the cluster's nodes by name, its etcd, its checkpoints."""

    nodes: dict[str, DaemonNode]
    etcd: EmbeddedEtcd | EmbeddedEtcdCluster
    ckpt_dir: Path
    lease_ttl_s: float = 5.0
    # Checkpoint files this run damaged on purpose: path -> step (the invariants exempt
    # them from "every committed checkpoint verifies" and forbid loading them).
    corrupted: dict[str, int] = field(default_factory=dict)
    # node -> its fake cloud metadata server (only when a fault needs them)
    metadata: dict[str, FakeMetadata] = field(default_factory=dict)

    def running(self) -> list[DaemonNode]:
        return [n for n in self.nodes.values() if n.running()]

    def rank0(self) -> DaemonNode | None:
        """The running node whose workers hold rank 0 now (its progress file says)."""
        return next((n for n in self.running() if (n.progress() or {}).get("rank") == 0), None)


# -- processes of a node ----------------------------------------------------------------------

def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _is_agent(proc: psutil.Process) -> bool:
    return is_agent(_cmdline(proc))


def agent_of(node: DaemonNode) -> psutil.Process | None:
    return next((p for p in node.tree()[1:] if _is_agent(p)), None)


def workers_of(node: DaemonNode) -> list[psutil.Process]:
    """The processes that run the training loop: the warm server's forked children, or
    cold scripts (a client is only their stand-in: killing it kills the worker by proxy)."""
    out = []
    for proc in node.tree()[1:]:
        cmd = _cmdline(proc)
        if "elasticd.warmstart" in cmd and "--serve" in cmd:
            with contextlib.suppress(psutil.Error):
                # (Not the torchrun agent it forked: that one shows its own command line.)
                out.extend(c for c in proc.children() if not _is_agent(c))
        elif node.script in cmd and not ({"torch.distributed.run", "elasticd.warmstart"} & set(cmd)):
            out.append(proc)
    return out


def first_worker(node: DaemonNode) -> psutil.Process:
    workers = workers_of(node)
    if not workers:
        raise InjectionError(f"node {node.name} has no live worker")
    return workers[0]


# How long a fault that kills a worker waits for one to exist: an overlapping fault may
# fire while the node's workers are between two incarnations (seed 43's overlap run: a
# worker-kill right after a preemption found none, and was not injected at all).
WORKER_WAIT_S = 60.0


def await_workers(find: Callable[[], list], what: str, timeout_s: float = WORKER_WAIT_S) -> list:
    """What ``find()`` returns once it is not empty (polled every 50 ms; the caller kills
    one at once and records that moment as ``t_fired``); ``InjectionError`` saying
    ``what`` after ``timeout_s``."""
    found: list = []

    def some() -> bool:
        found[:] = find()
        return bool(found)

    if not proctree.wait_for(some, timeout_s, 0.05):
        raise InjectionError(f"{what} within {timeout_s:.0f} s")
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss
    except psutil.Error:
        return -1


def _sigkill(proc: psutil.Process) -> Detail:
    pid = proc.pid
    try:
        proc.send_signal(signal.SIGCONT)  # a stopped process keeps SIGKILL pending otherwise
        proc.kill()
    except psutil.Error as exc:
        raise InjectionError(f"pid {pid} is gone: {exc}") from None
    return {"pid": pid}


# -- the injectors --------------------------------------------------------------------------

class Injector:
    """One fault. ``target_rule``: "node" (the scenario's target is used), "rank0"
    (always the rank-0 node), "cluster" (no node: etcd, the biggest worker ...)."""

    name: ClassVar[str]
    summary: ClassVar[str]
    target_rule: ClassVar[str] = "node"
    hold_s: ClassVar[float] = 0.0          # between inject and heal
    # Recovered means the hit node runs new workers, none of those it had before: an
    # agent's SIGKILL leaves its workers stepping until its successor's rendezvous
    # restarts them (seen), and a daemon's SIGKILL must not leave the old ones behind.
    replaces_workers: ClassVar[bool] = True
    etcd_members: ClassVar[int] = 1        # the etcd cluster size the fault needs
    needs_metadata: ClassVar[bool] = False  # each node polls its own fake metadata server
    # True: it acts on links, so the cluster runs on a network of its own (netlab), where
    # there is one etcd member and no fake metadata server (127.0.0.1 is the namespace's).
    network: ClassVar[bool] = False
    # False: the fault needs a setup the runner cannot make (a small mounted filesystem),
    # so it is left out of the command line's default draw and of the random sequence.
    drawn_by_default: ClassVar[bool] = True
    # The phases of its recovery (elasticd.lab.chaos.scenario.PHASES) an overlapping draw may
    # fire the next fault in: the ones the system goes through after this fault.
    phases: ClassVar[tuple[str, ...]] = ("inject",)
    # True: the fault lasts (a freeze, a cut) and a scenario may set how long (``for_s``).
    lasts: ClassVar[bool] = False

    def __init__(self, for_s: float | None = None) -> None:
        self.for_s = for_s   # the scenario's duration for a fault that lasts; None: its default

    def lasting(self, default_s: float) -> float:
        return default_s if self.for_s is None else self.for_s

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        raise NotImplementedError

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        return {}


class WorkerKill(Injector):
    name = "worker-kill"
    summary = "SIGKILL one training worker of the node"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        worker = await_workers(lambda: workers_of(victim), f"node {victim.name} had no live worker")[0]
        return _sigkill(worker) | {"t_fired": time.time()}


class OomKill(Injector):
    name = "oom-kill"
    summary = "SIGKILL the worker with the largest RSS in the cluster, as the kernel OOM killer does"
    target_rule = "cluster"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        # "node" in the detail: the node it hit, for the runner's recovered check.
        found = await_workers(lambda: [(_rss(w), n.name, w) for n in t.running() for w in workers_of(n)],
                              "the cluster had no live worker")
        rss, node, proc = max(found, key=lambda f: f[0])
        return {**_sigkill(proc), "node": node, "rss_bytes": rss, "t_fired": time.time()}


class AgentKill(Injector):
    name = "agent-kill"
    summary = "SIGKILL the node's torchrun agent (the daemon and the workers stay)"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        agent = agent_of(victim)
        if agent is None:
            raise InjectionError(f"node {victim.name} has no live agent")
        return _sigkill(agent)


class _Restarted(Injector):
    """A fault that takes the node's daemon down: healed by starting the node again, 2 s
    later (as a machine reboots, or systemd restarts the service)."""

    hold_s = 2.0
    # Lost: the survivors re-form in place; back: the node joins through a round.
    phases: ClassVar[tuple[str, ...]] = ("inject", "reform", "join", "round")

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        victim.start()
        return {"restarted": True}


class DaemonKill(_Restarted):
    name = "daemon-kill"
    summary = "SIGKILL the daemon alone, its agent and workers still running; restart it"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        self._below = victim.tree()[1:]
        detail = _sigkill(psutil.Process(victim.proc.pid))
        victim.proc.wait()
        return {**detail, "processes_below": len(self._below)}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        # The daemon's tree dies with it (parent-death signals): what is still alive after
        # the hold would be orphans beside the restarted daemon's workers.
        orphans = [p.pid for p in self._below if _alive(p)]
        return {"orphans_after_hold": orphans, **super().heal(t, victim)}


class NodeKill(_Restarted):
    name = "node-kill"
    summary = "SIGKILL the whole node (daemon, agent, workers) at once; restart it"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        victim.kill()
        return {}


class Rank0NodeKill(NodeKill):
    name = "rank0-node-kill"
    summary = "SIGKILL the whole node holding rank 0 (the checkpoint writer); restart it"
    target_rule = "rank0"


class NodeStop(Injector):
    name = "node-stop"
    summary = "SIGSTOP the whole node (silent) for longer than its lease; then SIGCONT"
    phases: ClassVar[tuple[str, ...]] = ("inject", "reform")
    lasts = True

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        victim.signal_tree(signal.SIGSTOP)
        return {"stopped_s": self.stopped_s(t)}

    def stopped_s(self, t: Target) -> float:
        return self.lasting(t.lease_ttl_s + 3.0)   # the lease expires; its peers cut it loose

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        time.sleep(self.stopped_s(t))
        victim.signal_tree(signal.SIGCONT)
        return {"continued": True}


class Drain(Injector):
    name = "drain"
    summary = "SIGTERM the daemon (a drain: checkpoint at an agreed step, leave); restart it"
    # The drain's stop, the restart of every worker, the next round (and later the rejoin).
    phases: ClassVar[tuple[str, ...]] = ("inject", "drain", "restart", "round", "join")

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        victim.proc.send_signal(signal.SIGTERM)
        return {}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        try:
            code = victim.proc.wait(timeout=90)
        except Exception:  # noqa: BLE001 - a drain that hangs is the finding; kill and go on
            victim.kill()
            code = None
        victim.start()
        return {"drain_exit_code": code, "restarted": True}


class EtcdRestart(Injector):
    """Every member at once: the single one, or all three of a cluster (a full outage)."""

    name = "etcd-restart"
    summary = "SIGKILL every etcd member, restart them 3 s later with their data"
    target_rule = "cluster"
    hold_s = 3.0
    replaces_workers = False   # training goes on through an etcd outage

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        t.etcd.kill()
        return {}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        t.etcd.start()
        return {"restarted": True}


def committed(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, data file) of every step directory whose manifest parses, newest first:
    what the writer committed, whole or since damaged (sizes and hashes are not checked)."""
    found = []
    for d in ckpt_dir.iterdir() if ckpt_dir.exists() else []:
        step = layout.parse_step_dir(d.name)
        if step is None:
            continue
        manifest = d / layout.MANIFEST_NAME
        try:
            parsed = Manifest.from_json(manifest.read_bytes(), str(manifest))
        except (OSError, CorruptCheckpointError):
            continue   # not committed (yet), or its commit marker itself is unreadable
        if parsed.step == step and len(parsed.files) == 1:
            found.append((step, d / next(iter(parsed.files))))
    return sorted(found, reverse=True)


def newest_committed(ckpt_dir: Path) -> tuple[int, Path] | None:
    """The newest committed step and its data file (see ``committed``)."""
    found = committed(ckpt_dir)
    return found[0] if found else None


def flip_tensor_bytes(path: Path, count: int = 8) -> int:
    """Flip ``count`` bytes in the middle of the largest stored entry of a torch.save zip
    (a tensor's storage): the file still loads, with a wrong value, unless it is verified.
    Returns the offset of the first flipped byte."""
    with zipfile.ZipFile(path) as zf:
        info = max(zf.infolist(), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(start)
        data = f.read(count)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return start


def corrupt_newest(t: Target) -> Detail:
    """Damage the newest committed checkpoint in place (its manifest still claims it)."""
    found = newest_committed(t.ckpt_dir)
    if found is None:
        raise InjectionError(f"no committed checkpoint in {t.ckpt_dir} yet")
    step, path = found
    offset = flip_tensor_bytes(path)
    t.corrupted[str(path)] = step
    return {"step": step, "file": path.name, "offset": offset}


class CheckpointCorrupt(Injector):
    """The newest committed checkpoint damaged under the live job, then a worker of the
    rank-0 node killed so that the job has to load a checkpoint again (an in-place
    recovery would load none): the load must skip the damaged one."""

    name = "checkpoint-corrupt"
    summary = "flip bytes in the newest committed checkpoint's tensors, then SIGKILL a rank-0 worker"
    target_rule = "rank0"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        detail = corrupt_newest(t)
        workers = workers_of(victim)
        if workers:
            detail |= {"then_killed": _sigkill(workers[0])["pid"]}
        return detail


def _wait_for_line(path: Path, needle: bytes, timeout_s: float) -> bool:
    """Poll ``path`` every millisecond for a new line containing ``needle`` (from its
    current end): a checkpoint write of the example takes a few ms."""
    start = path.stat().st_size if path.exists() else 0
    deadline = time.monotonic() + timeout_s
    tail = b""
    with open(path, "rb") as f:
        f.seek(start)
        while time.monotonic() < deadline:
            tail = (tail + f.read())[-4096:]
            if needle in tail:
                return True
            time.sleep(0.001)
    return False


def _writes_in_flight(ckpt_dir: Path) -> list[str]:
    """Temp files and manifest-less step directories: a write that had not committed."""
    found = []
    for d in ckpt_dir.iterdir() if ckpt_dir.exists() else []:
        if layout.parse_step_dir(d.name) is None:
            continue
        found += [f"{d.name}/{f.name}" for f in d.iterdir() if layout.is_temp(f.name)]
        if not (d / layout.MANIFEST_NAME).exists():
            found.append(f"{d.name}/ (no manifest)")
    return found


class CheckpointWriteKill(Injector):
    """SIGKILL the rank-0 worker the moment it logs ``checkpoint started`` (the write
    runs in the background): the half-written checkpoint must never count."""

    name = "checkpoint-write-kill"
    summary = "SIGKILL the rank-0 worker as it starts writing a checkpoint"
    target_rule = "rank0"

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        # No worker now is no refusal: one restarting (an overlapping fault killed it) logs
        # the line once it writes again.
        log = victim.worker_logs()[0]
        deadline = time.monotonic() + 60
        while True:
            if not _wait_for_line(log, b"checkpoint started", deadline - time.monotonic()):
                raise InjectionError(f"no checkpoint started on {victim.name} within 60 s "
                                     "by a worker still alive")
            # The writer as of the line: the worker seen before the wait may have been
            # replaced meanwhile (an overlapping fault restarted it: "pid ... is gone"), and
            # the line's own writer may be gone (seed 41's overlap run: a worker-kill one
            # step before): then the next write is the one to catch.
            if workers_of(victim):
                break
        detail = _sigkill(first_worker(victim)) | {"t_fired": time.time()}
        # What the kill caught (a write not yet committed), for the report.
        return {**detail, "in_flight": _writes_in_flight(t.ckpt_dir)}


# The faults of the etcd cluster and the cloud live in their own module, which subclasses
# Injector above (elasticd/lab/chaos/__init__.py imports this module first, so either order works).
from elasticd.lab.chaos.cluster_faults import (  # noqa: E402
    CheckpointDirFull,
    EtcdLeaderKill,
    EtcdQuorumLoss,
    FlappingNode,
    PreemptionNotice,
)

INJECTORS: dict[str, type[Injector]] = {cls.name: cls for cls in (
    WorkerKill, OomKill, AgentKill, DaemonKill, NodeKill, Rank0NodeKill, NodeStop, Drain,
    EtcdRestart, CheckpointCorrupt, CheckpointWriteKill, EtcdLeaderKill, EtcdQuorumLoss,
    PreemptionNotice, FlappingNode, CheckpointDirFull)}

# The network faults (net_faults.py: partitions, delay and loss) add their names to the
# registry when that module is imported; importing it here makes every user of the
# registry see them.
import elasticd.lab.chaos.net_faults  # noqa: E402,F401


def default_kinds() -> list[str]:
    """The fault kinds a draw uses unless told otherwise (see ``drawn_by_default``)."""
    return sorted(name for name, cls in INJECTORS.items() if cls.drawn_by_default)
