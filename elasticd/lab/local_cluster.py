"""Several nodes on one machine (loopback): the one harness of the demo, the tests and
the benchmarks. Nothing here is needed on a real cluster.

Two kinds of node, both "one simulated machine = one root process and its tree":

* ``DaemonNode`` (alias ``LocalNode``): ``python -m elasticd run`` with its own config
  file, run dir (progress and stop files, agent log) and daemon log;
* ``TorchrunNode``: a plain torchrun agent (``--rdzv-backend=etcd3`` or ``c10d``) running
  a script directly, without the daemon; ``AllreduceNode`` runs the rendezvous tests'
  worker (``tests/workers/allreduce.py``) and reads its per-step reports.

Every node of a cluster shares one checkpoint directory (``<root>/ckpt``), as real nodes
share an NFS mount. ``local_cluster()`` is a context manager that owns a root directory,
optionally an etcd, and every process started while it is open: on exit, normal or not,
it kills them all (SIGCONT first, so a SIGSTOPped node dies too).

``local_cluster(network=True)`` puts every daemon node and the etcd in a network
namespace of its own (``elasticd.lab.netlab``: veth pairs to a bridge in another namespace,
addresses in 10.77.0.0/24; a node advertises its own as ``node.addr``), so that the
chaos harness can cut and slow one node's links (``elasticd.lab.chaos.net_faults``) without
touching the machine's loopback; the namespaces go with the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Self, TypeVar

import psutil

from elasticd import proctree
from elasticd.lab import netlab
from elasticd.lab.embedded_etcd import EmbeddedEtcd, EmbeddedEtcdCluster

REPO = Path(__file__).resolve().parents[2]
MLP = str(REPO / "trainer" / "examples" / "mlp.py")
CHARLM = str(REPO / "trainer" / "examples" / "charlm.py")
# The rendezvous tests' worker: one all-reduce per step, one JSON report line per step.
ALLREDUCE = str(REPO / "tests" / "workers" / "allreduce.py")
TRAIN_ARGS: tuple[str, ...] = ("--max-steps", "1000000", "--step-sleep", "0.05", "--log-every", "100")
# Fast but safe torch rendezvous knobs for agents without the daemon: 1 s x 3 keep-alive
# evicts a dead node in ~3 s (1 x 2 self-evicts live nodes; see DESIGN.md).
FAST_RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


def write_config(path: Path, *, job: str, node: str, endpoint: str, run_dir: Path, ckpt_dir: Path,
                 min_nodes: int = 1, max_nodes: int = 3, entrypoint: list[str] | None = None,
                 lease_ttl_s: int = 5, every_steps: int = 20, extra: str = "",
                 sections: str = "", recovery: str | None = None, addr: str = "127.0.0.1",
                 warm_start: bool = True, secret_file: Path | None = None,
                 worker_user: str = "", python: str = "") -> Path:
    """A node's TOML config; ``extra`` lines go into [supervisor], ``sections`` at the end.

    ``endpoint``: one etcd endpoint, or several comma-separated (every member of a cluster).

    ``recovery``: ``[recovery] mode`` ("in-place" | "restart"); None leaves the config's
    default (in-place) and the section to ``sections``. ``addr``: ``node.addr``, the
    address the node binds and advertises. ``warm_start``: ``[job] warm_start`` (False: every
    worker of the node starts cold). ``secret_file``: ``[recovery] secret_file`` (the job's
    secret). ``worker_user``: ``[job] worker_user`` (the workers' Unix user; "": the
    daemon's). ``python``: ``[job] python`` (torchrun's and the workers' interpreter; "":
    the daemon's).
    """
    entry = entrypoint or [MLP, *TRAIN_ARGS]
    if recovery is not None:
        sections = f'[recovery]\nmode = "{recovery}"\n{sections}'
    if secret_file is not None:
        line = f"secret_file = {json.dumps(str(secret_file))}\n"
        sections = (sections.replace("[recovery]\n", "[recovery]\n" + line, 1)
                    if "[recovery]\n" in sections else f"[recovery]\n{line}{sections}")
    path.write_text(f"""
[job]
id = "{job}"
min_nodes = {min_nodes}
max_nodes = {max_nodes}
nproc_per_node = 1
entrypoint = {json.dumps(entry)}
warm_start = {json.dumps(warm_start)}
worker_user = {json.dumps(worker_user)}
{f"python = {json.dumps(python)}" if python else ""}

[etcd]
endpoints = {json.dumps(endpoint.split(","))}

[node]
id = "{node}"
addr = "{addr}"
lease_ttl_s = {lease_ttl_s}
probe_interval_s = 0.5
run_dir = "{run_dir}"

[checkpoint]
dir = "{ckpt_dir}"
every_steps = {every_steps}
keep_last = 3

[supervisor]
backoff_initial_s = 0.5
drain_grace_s = 30
{extra}
{sections}
""")
    return path


def job_secret(root: Path) -> Path:
    """The job's secret file of the nodes under ``root`` (one per cluster: every node of
    the job shares it, as an operator copies it to each; mode 600), made on first use."""
    path = root / "job.secret"
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    return path


def base_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a node, without anything elasticd reads as settings.

    An ``ELASTICD_NODE_ID`` (or any override) left in the harness' environment would
    otherwise reach every local node and make them one node; torch's store-sharing
    switch is per node kind, so it is set explicitly where wanted.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICD_", "TORCH_DISABLE_SHARE"))}
    return env | {"PYTHONUNBUFFERED": "1"} | (extra or {})


# -- readers of logs and progress files ----------------------------------------------------

def is_agent(cmdline: list[str]) -> bool:
    """Whether a process's command line is a torchrun agent's: a cold one, or one forked by
    the warm-start server (its title, one string: setproctitle). Not the server's own,
    whose import list names torchrun's module too, nor a worker it forked (the server's)."""
    return "-m torch.distributed.run" in " ".join(cmdline)


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every JSON object of a log, one per line (a line may start with a prefix, as
    torchrun's ``[rank0]:`` or a timestamp)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        start = line.find("{")
        if start < 0:
            continue
        with contextlib.suppress(ValueError):
            record = json.loads(line[start:])
            if isinstance(record, dict):
                out.append(record)
    return out


def record_time(record: dict[str, Any]) -> float | None:
    """A structlog line's ``timestamp`` (ISO 8601) as a Unix time, None if absent or bad."""
    stamp = record.get("timestamp")
    if not isinstance(stamp, str):
        return None
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(stamp).timestamp()
    return None


def read_progress(path: Path) -> dict[str, Any] | None:
    """The last step record a node's rank 0 wrote (None before the first, or mid-write)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# -- nodes -----------------------------------------------------------------------------------

@dataclass
class Node:
    """What every local node has: a root process started from ``command()``, its tree,
    its logs and its progress file, for job ``job`` whose rendezvous is at ``endpoint``
    (etcd, or a c10d store). Files go under ``root``, shared by the cluster's nodes."""

    name: str
    endpoint: str
    job: str
    root: Path
    # kw_only: it goes after every subclass field, out of the positional order callers use.
    proc: subprocess.Popen | None = field(default=None, repr=False, kw_only=True)
    # Put before the command: the node's network namespace (netlab.Network.prefix), if any.
    prefix: list[str] = field(default_factory=list, kw_only=True)

    # -- what a kind of node defines
    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return base_env()

    @property
    def log_path(self) -> Path:
        """Where the root process's stdout and stderr go."""
        raise NotImplementedError

    @property
    def script(self) -> str:
        """The training script the workers run (how they are told from agents)."""
        raise NotImplementedError

    def worker_logs(self) -> list[Path]:
        """The logs the workers write to (through their agent)."""
        return [self.log_path]

    def prepare(self) -> None:
        """Files the node needs before it starts."""

    # -- shared
    @property
    def run_dir(self) -> Path:
        return self.root / self.name

    @property
    def progress_path(self) -> Path:
        return self.run_dir / "progress.json"

    def start(self) -> Self:
        """Start (or restart, after ``kill``) the node; its logs are appended to."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # A restarted node's old progress is history, not its present.
        self.progress_path.unlink(missing_ok=True)
        self.prepare()
        # A process group of its own, in this session: a harness started in the background
        # (nohup ... &) sits in an orphaned process group, and the kernel sends SIGHUP and
        # SIGCONT to every member of an orphaned group with a stopped member whenever one of
        # them exits; a frozen node there got every daemon reloading, every agent dead of
        # SIGHUP, and itself continued (seen in a chaos run: node-stop, then all restarted).
        # The node's own group is not orphaned while this process, its parent, lives.
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*self.prefix, *self.command()], env=self.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         process_group=0)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    alive = running

    def progress(self) -> dict[str, Any] | None:
        return read_progress(self.progress_path)

    def tree(self) -> list[psutil.Process]:
        """Root and every live descendant, captured before anything is signalled."""
        if self.proc is None:
            return []
        with contextlib.suppress(psutil.NoSuchProcess):
            return [psutil.Process(self.proc.pid), *proctree.descendants(self.proc.pid)]
        return []

    def workers(self) -> list[psutil.Process]:
        """The live training workers under this node (not the agent, not the daemon)."""
        out = []
        for proc in self.tree()[1:]:
            with contextlib.suppress(psutil.Error):
                cmd = proc.cmdline()
                if self.script in cmd and "torch.distributed.run" not in cmd:
                    out.append(proc)
        return out

    def signal_tree(self, sig: int) -> None:
        """Send ``sig`` to the whole tree in one sweep (SIGSTOP: a frozen machine)."""
        if not self.running():
            return
        signal_all(self.tree(), sig)

    def kill(self) -> None:
        """SIGKILL the whole node at once: root, agent and workers (a machine crash)."""
        if self.proc is None:
            return
        self.signal_tree(signal.SIGCONT)   # a stopped process keeps SIGKILL pending otherwise
        proctree.kill_tree(self.proc.pid)
        self.proc.wait()

    def logs(self) -> list[Path]:
        return list(dict.fromkeys([self.log_path, *self.worker_logs()]))

    def log_tail(self, chars: int = 4000) -> str:
        parts = []
        for path in self.logs():
            text = path.read_text(errors="replace")[-chars:] if path.exists() else ""
            parts.append(f"--- {self.name} {path.name}\n{text}")
        return "\n".join(parts)

    def log_events(self) -> list[dict[str, Any]]:
        """Every JSON line with a string ``event`` in any of the node's logs."""
        return [r for path in self.logs() for r in json_lines(path) if isinstance(r.get("event"), str)]

    def worker_events(self, event: str) -> list[dict[str, Any]]:
        """The trainer's JSON log lines with this event, from the workers' logs."""
        return [r for path in self.worker_logs() for r in json_lines(path) if r.get("event") == event]


@dataclass
class DaemonNode(Node):
    """One daemon (and, under it, its torchrun agent and workers) run as a subprocess.

    ``config_kw`` goes to ``write_config`` (entrypoint, min/max nodes, extra lines ...).
    ``ckpt_dir``: this node's checkpoint directory (default: the cluster's shared one;
    another stands for a node whose mount failed).
    """

    config_kw: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    ckpt_dir: Path | None = None

    @property
    def config_path(self) -> Path:
        return self.root / f"{self.name}.toml"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.daemon.log"

    @property
    def script(self) -> str:
        entry = self.config_kw.get("entrypoint") or [MLP]
        return entry[0]

    def worker_logs(self) -> list[Path]:
        return [self.run_dir / "agent.log"]

    def prepare(self) -> None:
        kw = {"secret_file": job_secret(self.root), **self.config_kw}
        write_config(self.config_path, job=self.job, node=self.name, endpoint=self.endpoint,
                     run_dir=self.run_dir, ckpt_dir=self.ckpt_dir or self.root / "ckpt", **kw)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "elasticd", "run", "--config", str(self.config_path)]

    def environment(self) -> dict[str, str]:
        return base_env(self.env)

    def daemon_events(self) -> list[dict[str, Any]]:
        """The daemon's JSON log lines."""
        return json_lines(self.log_path)


LocalNode = DaemonNode


@dataclass
class TorchrunNode(Node):
    """A plain torchrun agent (no daemon) and its workers.

    ``backend``: ``etcd3`` (this project's plugin; ``endpoint`` is etcd) or ``c10d``
    (``endpoint`` is the store; ``is_host`` makes this agent host it). The workers get
    the trainer's settings in the environment: progress file, the shared checkpoint dir
    and ``every_steps``. ``monitor_interval_s`` None leaves torch's default.
    """

    backend: str = "etcd3"
    nnodes: str = "2:3"
    nproc: int = 1
    max_restarts: int = 1000
    rdzv_conf: str = FAST_RDZV_CONF
    is_host: bool | None = None
    monitor_interval_s: float | None = 0.1
    script_path: str = MLP
    script_args: tuple[str, ...] = TRAIN_ARGS
    every_steps: int = 20
    env: dict = field(default_factory=dict)

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.log"

    @property
    def script(self) -> str:
        return self.script_path

    def command(self) -> list[str]:
        conf = ",".join(c for c in (
            None if self.is_host is None else f"is_host={int(self.is_host)}", self.rdzv_conf) if c)
        return [sys.executable, "-m", "torch.distributed.run", f"--rdzv-backend={self.backend}",
                f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.job}",
                *([f"--rdzv-conf={conf}"] if conf else []),
                f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}",
                f"--max-restarts={self.max_restarts}", "--local-addr=127.0.0.1",
                *([f"--monitor-interval={self.monitor_interval_s}"] if self.monitor_interval_s else []),
                self.script_path, *self.script_args]

    def environment(self) -> dict[str, str]:
        return base_env({
            "ELASTICD_PROGRESS_FILE": str(self.progress_path),
            "ELASTICD_CHECKPOINT_DIR": str(self.root / "ckpt"),
            "ELASTICD_CHECKPOINT_EVERY_STEPS": str(self.every_steps),
        } | self.env)


@dataclass
class AllreduceNode(TorchrunNode):
    """A torchrun agent running ``tests/workers/allreduce.py``: each worker appends one
    JSON line per step to ``<root>/<node>-<local_rank>.jsonl`` and stops at the next step
    once ``<root>/stop`` exists (``stop_allreduce``)."""

    script_path: str = ALLREDUCE
    script_args: tuple[str, ...] = ()
    step_sleep: float = 0.2

    def environment(self) -> dict[str, str]:
        return super().environment() | {
            "REPORT_DIR": str(self.root), "NODE_NAME": self.name,
            "STOP_FILE": str(self.root / "stop"), "STEP_SLEEP": str(self.step_sleep)}


def reports(report_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every allreduce worker's step records, keyed by '<node>-<local_rank>'."""
    out = {}
    for path in report_dir.glob("*.jsonl"):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        # The last line may be half written while a worker runs.
        out[path.stem] = [json.loads(line) for line in lines if line.endswith("}")]
    return out


def latest(report_dir: Path, node: str) -> dict[str, Any] | None:
    """The newest step record of a node's local rank 0."""
    records = reports(report_dir).get(f"{node}-0", [])
    return records[-1] if records else None


def world_after(report_dir: Path, nodes: list[str], world: int, since: float) -> bool:
    """Each named node has completed a correct step in a world of ``world`` after ``since``."""
    for node in nodes:
        records = reports(report_dir).get(f"{node}-0", [])
        if not any(r["world"] == world and r["ok"] and r["t"] > since for r in records):
            return False
    return True


def stop_allreduce(nodes: list[TorchrunNode], report_dir: Path, timeout_s: float = 30) -> list[int | None]:
    """Ask the allreduce workers to finish (the stop file), then make sure nothing is left.

    Returns each agent's exit code, None where it had to be killed."""
    (report_dir / "stop").touch()
    deadline = time.monotonic() + timeout_s
    codes: list[int | None] = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(deadline - time.monotonic(), 0.1)) if node.proc else None)
        except subprocess.TimeoutExpired:
            codes.append(None)
        node.kill()
    return codes


def stepping_at(nodes: list[Node], world: int, since_wall: float) -> bool:
    """Each node's workers completed a step at world size ``world`` after ``since_wall``."""
    for node in nodes:
        p = node.progress()
        if not p or p.get("world_size") != world or p.get("time", 0) <= since_wall:
            return False
    return True


def stop_all(nodes: Iterable[Node]) -> None:
    """Kill every node that still runs (stopped ones are continued first)."""
    for node in nodes:
        if node.running():
            node.kill()


class WaitTimeout(AssertionError):
    """``wait_for`` gave up; the message has the nodes' log tails. An AssertionError, so
    a test that times out reads as a failed expectation."""


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str,
             nodes: Iterable[Node] = ()) -> None:
    """Poll ``predicate`` every 0.1 s; raise ``WaitTimeout`` with the nodes' logs after ``timeout_s``."""
    if proctree.wait_for(predicate, timeout_s, 0.1):
        return
    logs = "\n".join(n.log_tail() for n in nodes)
    raise WaitTimeout(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


# -- processes and clusters --------------------------------------------------------------

def signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    """Send ``sig`` to every process in one sweep, without waiting."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid}:{' '.join(proc.cmdline())[:120]}"
    except psutil.Error:
        return str(proc.pid)


def _identity(proc: psutil.Process) -> tuple[int, float] | None:
    # pid and start time: a pid reused by a new process is not the one seen before.
    try:
        return proc.pid, proc.create_time()
    except psutil.Error:
        return None


def kill_descendants(spare: set[tuple[int, float]] = frozenset(), timeout_s: float = 15.0) -> list[str]:
    """SIGCONT then SIGKILL every descendant of this process except ``spare``; reap them.

    Descendants include orphans only if this process is the child subreaper (the demo,
    the benchmark and the test suite make themselves one). Returns the processes still
    alive after ``timeout_s`` (should be none).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        procs = [p for p in proctree.descendants() if _identity(p) not in spare]
        if not procs:
            return []
        if time.monotonic() > deadline:
            return [describe(p) for p in procs]
        signal_all(procs, signal.SIGCONT)
        signal_all(procs, signal.SIGKILL)
        time.sleep(0.1)
        proctree.reap_children()


N = TypeVar("N", bound=Node)


class Cluster:
    """Nodes on one machine under one root directory, optionally with their own etcd (one
    member or a cluster of three).

    Use ``local_cluster()``: it guarantees ``stop()``. ``add`` starts a node and keeps it;
    ``daemon`` and ``torchrun`` build and add the two kinds with the cluster's root and
    etcd endpoint filled in.
    """

    def __init__(self, root: Path, etcd: EmbeddedEtcd | EmbeddedEtcdCluster | None = None,
                 net: netlab.Network | None = None) -> None:
        self.root = root
        self.etcd = etcd
        self.net = net
        self.nodes: list[Node] = []
        self.leftover: list[str] = []   # what the last stop() could not kill
        # Everything alive now is not ours to kill (a test's session etcd, say).
        self._before = {i for p in proctree.descendants() if (i := _identity(p))}

    @property
    def endpoint(self) -> str:
        if self.etcd is None:
            raise RuntimeError("this cluster has no etcd; pass etcd=True to local_cluster()")
        return ",".join(self.etcd.endpoints)   # a daemon gets every member

    def add(self, node: N, start: bool = True) -> N:
        self.nodes.append(node)
        return node.start() if start else node

    def daemon(self, name: str, job: str, env: dict | None = None, start: bool = True,
               **config_kw: Any) -> DaemonNode:
        """A daemon node; on a cluster with a network, in a namespace of its own."""
        if self.net is None:
            return self.add(DaemonNode(name, self.endpoint, job, self.root, config_kw, env or {}), start)
        member = self.net.add(name)
        # gloo binds the address the hostname resolves to (loopback here), which peers in
        # other namespaces cannot reach: it must use the node's link.
        env = {"GLOO_SOCKET_IFNAME": "eth0", **(env or {})}
        node = DaemonNode(name, self.endpoint, job, self.root, {**config_kw, "addr": member.addr},
                          env, prefix=self.net.prefix(name))
        return self.add(node, start)

    def torchrun(self, name: str, job: str, endpoint: str | None = None, start: bool = True,
                 kind: type[TorchrunNode] = TorchrunNode, **kw: Any) -> TorchrunNode:
        if self.net is not None:
            raise ValueError("plain torchrun nodes run on loopback: use a cluster without a network")
        return self.add(kind(name, endpoint or self.endpoint, job, self.root, **kw), start)

    def stop(self) -> list[str]:
        """Kill every node, then anything else started since the cluster opened (orphaned
        workers included), then its etcd. Returns what survived (should be nothing)."""
        stop_all(self.nodes)
        spare = set(self._before)
        for proc in self.etcd.processes() if self.etcd is not None else []:
            # etcd (maybe restarted by a test since) goes last, by its own stop().
            with contextlib.suppress(psutil.Error):
                spare |= {i for i in [_identity(psutil.Process(proc.pid))] if i}
        left = kill_descendants(spare)
        if self.etcd is not None:
            self.etcd.stop()
        proctree.reap_children()
        # Last: a namespace deleted while a process is in it lives on, unnamed.
        if self.net is not None:
            left += [f"netns {n}" for n in self.net.close()]
        self.leftover = left
        return left


@contextlib.contextmanager
def local_cluster(root: Path | None = None, *, etcd: bool = True, keep: bool = False,
                  network: bool = False, etcd_members: int = 1) -> Iterator[Cluster]:
    """A ``Cluster`` whose processes (and namespaces) are all gone when the block ends,
    however it ends.

    ``root``: the directory for configs, logs and checkpoints (default: a temp dir,
    removed at the end unless ``keep``). ``etcd``: start a throw-away etcd in it, one
    member (``EmbeddedEtcd``) or, with ``etcd_members=3``, an ``EmbeddedEtcdCluster``
    whose every endpoint the daemons get. ``network``: every daemon node and the etcd in
    a network namespace of its own (``elasticd.lab.netlab``; needs root; one etcd member).
    """
    if etcd_members not in (1, 3):
        raise ValueError(f"etcd_members={etcd_members}: 1 or 3")
    if network and etcd_members != 1:
        raise ValueError("network=True runs one etcd member in its namespace; use "
                         "etcd_members=1 (a 3-member cluster is on loopback only)")
    own = root is None
    root = Path(tempfile.mkdtemp(prefix="elasticd-cluster-")) if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    net = netlab.Network() if network else None
    cluster = Cluster(root, None, net)
    try:
        if net is not None:
            net.open()
        if etcd and etcd_members == 3:
            cluster.etcd = EmbeddedEtcdCluster(root / "etcd").start()
        elif etcd:
            where = {} if net is None else {
                "host": netlab.ETCD_HOST, "netns": net.add("etcd", netlab.ETCD_HOST).netns}
            cluster.etcd = EmbeddedEtcd(data_dir=str(root / "etcd"), **where).start()
        yield cluster
    finally:
        cluster.stop()
        if own and not keep:
            shutil.rmtree(root, ignore_errors=True)
