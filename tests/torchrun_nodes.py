"""Test helpers: torchrun agents on loopback acting as nodes, and their workers' reports.

Each node runs ``tests/workers/allreduce.py`` under a real torchrun agent with
the etcd3 rendezvous backend. Workers append one JSON line per step to
``<report_dir>/<node>-<local_rank>.jsonl``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elasticd import proctree

WORKER = Path(__file__).parent / "workers" / "allreduce.py"
# Fast but safe torch rendezvous knobs for tests without the daemon: 1 s x 3
# keep-alive evicts a dead node in ~3 s (1 x 2 self-evicts; see DESIGN.md).
FAST_RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=120"


@dataclass
class TorchrunNode:
    name: str
    endpoint: str
    job: str
    report_dir: Path
    nnodes: str = "2:3"
    nproc: int = 1
    step_sleep: float = 0.2
    rdzv_conf: str = FAST_RDZV_CONF
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> TorchrunNode:
        env = dict(os.environ, REPORT_DIR=str(self.report_dir), NODE_NAME=self.name,
                   STOP_FILE=str(self.report_dir / "stop"), STEP_SLEEP=str(self.step_sleep),
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=etcd3",
               f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.job}",
               f"--nnodes={self.nnodes}", f"--nproc-per-node={self.nproc}", "--max-restarts=1000",
               "--local-addr=127.0.0.1", "--monitor-interval=0.1", f"--rdzv-conf={self.rdzv_conf}",
               str(WORKER)]
        log = open(self.report_dir / f"{self.name}.log", "ab")  # noqa: SIM115 (owned by the child)
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def kill(self) -> None:
        """SIGKILL the agent and all its workers at once, as a node crash would."""
        if self.proc is not None:
            proctree.kill_tree(self.proc.pid)
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        path = self.report_dir / f"{self.name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def reports(report_dir: Path) -> dict[str, list[dict]]:
    """Every worker's step records, keyed by '<node>-<local_rank>'."""
    out = {}
    for path in report_dir.glob("*.jsonl"):
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        out[path.stem] = [json.loads(line) for line in lines if line.endswith("}")]
    return out


def latest(report_dir: Path, node: str) -> dict | None:
    records = reports(report_dir).get(f"{node}-0", [])
    return records[-1] if records else None


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str,
               nodes: list[TorchrunNode] = ()) -> None:
    if proctree.wait_for(predicate, timeout_s, 0.1):
        return
    logs = "\n".join(f"--- {n.name}\n{n.log_tail()}" for n in nodes)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


def world_after(report_dir: Path, nodes: list[str], world: int, since: float) -> bool:
    """Each named node has completed a correct step in a world of ``world`` after ``since``."""
    for node in nodes:
        records = reports(report_dir).get(f"{node}-0", [])
        if not any(r["world"] == world and r["ok"] and r["t"] > since for r in records):
            return False
    return True


def stop_all(nodes: list[TorchrunNode], report_dir: Path, timeout_s: float = 30) -> list[int | None]:
    """Ask the workers to finish (stop file), then make sure nothing is left."""
    (report_dir / "stop").touch()
    deadline = time.monotonic() + timeout_s
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
        node.kill()
    return codes
