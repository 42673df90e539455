"""Several elasticd nodes on one machine (loopback), for the demo, the tests and benchmarks.

Every node gets its own config file, run dir (progress and stop files, agent log)
and daemon log; all share one checkpoint directory, as real nodes share an NFS
mount. Nothing here is needed on a real cluster.
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

import psutil

from elasticd import proctree

REPO = Path(__file__).resolve().parents[1]
MLP = str(REPO / "trainer" / "examples" / "mlp.py")
CHARLM = str(REPO / "trainer" / "examples" / "charlm.py")


def write_config(path: Path, *, job: str, node: str, endpoint: str, run_dir: Path, ckpt_dir: Path,
                 min_nodes: int = 1, max_nodes: int = 3, entrypoint: list[str] | None = None,
                 lease_ttl_s: int = 5, every_steps: int = 20, extra: str = "",
                 sections: str = "") -> Path:
    """A node's TOML config; ``extra`` lines go into [supervisor], ``sections`` at the end."""
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
every_steps = {every_steps}
keep_last = 3

[supervisor]
backoff_initial_s = 0.5
drain_grace_s = 30
{extra}
{sections}
""")
    return path


@dataclass
class LocalNode:
    """One daemon (and, under it, its torchrun agent and workers) run as a subprocess."""

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

    def start(self) -> LocalNode:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "progress.json").unlink(missing_ok=True)
        write_config(self.config_path, job=self.job, node=self.name, endpoint=self.endpoint,
                     run_dir=self.run_dir, ckpt_dir=self.root / "ckpt", **self.config_kw)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "elasticd", "run", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env))
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def progress(self) -> dict | None:
        """The last step record the node's workers wrote (None before the first)."""
        try:
            return json.loads((self.run_dir / "progress.json").read_text())
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        """SIGKILL the whole node at once: daemon, agent and workers (a crash)."""
        if self.proc is not None:
            self.signal_tree(signal.SIGCONT)
            proctree.kill_tree(self.proc.pid)
            self.proc.wait()

    def signal_tree(self, sig: int) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for proc in [*proctree.descendants(self.proc.pid), psutil.Process(self.proc.pid)]:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)

    def log_tail(self, chars: int = 4000) -> str:
        daemon = self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""
        agent_log = self.run_dir / "agent.log"
        agent = agent_log.read_text(errors="replace")[-chars:] if agent_log.exists() else ""
        return f"--- {self.name} daemon\n{daemon}\n--- {self.name} agent\n{agent}"

    def daemon_events(self) -> list[dict]:
        """The daemon's JSON log lines."""
        return _json_lines(self.log_path)

    def worker_events(self, event: str) -> list[dict]:
        """The trainer's JSON log lines with this event, from the node's agent log."""
        return [r for r in _json_lines(self.run_dir / "agent.log") if r.get("event") == event]


def _json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        start = line.find("{")
        if start < 0:
            continue
        with contextlib.suppress(ValueError):
            out.append(json.loads(line[start:]))
    return out


def stepping_at(nodes: list[LocalNode], world: int, since_wall: float) -> bool:
    """Each node's workers completed a step at world size ``world`` after ``since_wall``."""
    for node in nodes:
        p = node.progress()
        if not p or p.get("world_size") != world or p.get("time", 0) <= since_wall:
            return False
    return True


def stop_all(nodes: list[LocalNode]) -> None:
    """Kill every node that still runs (stopped ones are continued first)."""
    for node in nodes:
        if node.running():
            node.kill()
