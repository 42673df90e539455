"""Test helpers: real elasticd daemons on loopback, each running real torchrun workers.

Every node gets its own config file, run dir (progress and stop files, agent
log) and daemon log; all share one checkpoint directory, as nodes would share
an NFS mount.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from elasticd import proctree

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "trainer" / "examples" / "mlp.py")


def write_config(path: Path, *, job: str, node: str, endpoint: str, run_dir: Path, ckpt_dir: Path,
                 min_nodes: int = 1, max_nodes: int = 3, entrypoint: list[str] | None = None,
                 lease_ttl_s: int = 5, extra: str = "", sections: str = "") -> Path:
    entry = entrypoint or [MLP, "--max-steps", "1000000", "--step-sleep", "0.05", "--log-every", "100"]
    path.write_text(f"""
[job]
id = "{job}"
min_nodes = {min_nodes}
max_nodes = {max_nodes}
nproc_per_node = 1
entrypoint = {json.dumps(entry)}

[etcd]
endpoints = ["{endpoint}"]

[node]
id = "{node}"
addr = "127.0.0.1"
lease_ttl_s = {lease_ttl_s}
probe_interval_s = 0.5
run_dir = "{run_dir}"

[checkpoint]
dir = "{ckpt_dir}"
every_steps = 20
keep_last = 3

[supervisor]
backoff_initial_s = 0.5
drain_grace_s = 30
{extra}
{sections}
""")
    return path


@dataclass
class DaemonNode:
    name: str
    endpoint: str
    job: str
    root: Path
    config_kw: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def run_dir(self) -> Path:
        return self.root / self.name

    @property
    def config_path(self) -> Path:
        return self.root / f"{self.name}.toml"

    @property
    def log_path(self) -> Path:
        return self.root / f"{self.name}.daemon.log"

    def start(self) -> DaemonNode:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_config(self.config_path, job=self.job, node=self.name, endpoint=self.endpoint,
                     run_dir=self.run_dir, ckpt_dir=self.root / "ckpt", **self.config_kw)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "elasticd", "run", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        return self

    def progress(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "progress.json").read_text())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the whole node: daemon, agent and workers at once."""
        if self.proc is not None:
            proctree.kill_tree(self.proc.pid)
            self.proc.wait()

    def signal_tree(self, sig: int) -> None:
        for proc in [*proctree.descendants(self.proc.pid), __import__("psutil").Process(self.proc.pid)]:
            with contextlib.suppress(Exception):
                proc.send_signal(sig)

    def terminate(self, timeout_s: float = 60) -> int | None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, chars: int = 4000) -> str:
        daemon = self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
        agent_log = self.run_dir / "agent.log"
        agent = agent_log.read_text(errors="replace")[-chars:] if agent_log.exists() else ""
        return f"--- {self.name} daemon\n{daemon}\n--- {self.name} agent\n{agent}"


def wait_for(predicate, timeout_s: float, what: str, nodes=()) -> None:
    if proctree.wait_for(predicate, timeout_s, 0.1):
        return
    logs = "\n".join(n.log_tail() for n in nodes)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


def stepping_at(nodes: list[DaemonNode], world: int, since_wall: float) -> bool:
    """Each node's workers completed a step at world size ``world`` after ``since_wall``."""
    for node in nodes:
        p = node.progress()
        if not p or p.get("world_size") != world or p.get("time", 0) <= since_wall:
            return False
    return True


def log_lines(node: DaemonNode) -> list[dict]:
    out = []
    for line in node.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def agent_events(node: DaemonNode, event: str) -> list[dict]:
    """The trainer's JSON log lines with this event from the node's agent log."""
    out = []
    path = node.run_dir / "agent.log"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        start = line.find("{")
        if start < 0:
            continue
        with contextlib.suppress(ValueError):
            rec = json.loads(line[start:])
            if rec.get("event") == event:
                out.append(rec)
    return out


def stop_nodes(nodes: list[DaemonNode]) -> None:
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.signal_tree(signal.SIGCONT)
            node.kill()

