"""Test helpers: the example scripts under a real ``torchrun --standalone``, and their logs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elasticd import proctree

EXAMPLES = Path(__file__).resolve().parents[2] / "trainer" / "examples"


@dataclass
class Launch:
    """One ``python -m torch.distributed.run --standalone`` of an example script."""

    workdir: Path
    name: str
    nproc: int
    args: list[str]
    script: str = "mlp.py"
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def log_path(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def progress_path(self) -> Path:
        return self.workdir / f"{self.name}.progress.json"

    def start(self) -> Launch:
        # PYTHONFAULTHANDLER: a hung process dumps its threads' stacks on SIGABRT (see wait).
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **self.env)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={self.nproc}", "--max-restarts=0", "--monitor-interval=0.1",
               str(EXAMPLES / self.script), "--log-every=1",
               f"--progress-file={self.progress_path}", *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def run(self, timeout_s: float = 90) -> int:
        """Start, wait for the exit, return the agent's exit code."""
        self.start()
        return self.wait(timeout_s)

    def wait(self, timeout_s: float = 90) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            self._dump_stacks()
            self.kill()
            raise AssertionError(f"{self.name} did not exit in {timeout_s} s:\n{self.tail()}") from exc

    def _dump_stacks(self) -> None:
        """Make every process of the launch write its Python stacks to the log."""
        assert self.proc is not None
        for proc in [*proctree.descendants(self.proc.pid), psutil.Process(self.proc.pid)]:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGABRT)
        time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL the agent and every worker (they run in their own sessions)."""
        if self.proc is not None:
            proctree.kill_tree(self.proc.pid)
            self.proc.wait()

    def workers(self) -> list[psutil.Process]:
        """The worker processes, ordered by RANK."""
        assert self.proc is not None
        found = [p for p in proctree.descendants(self.proc.pid) if _is_worker(p, self.script)]
        return sorted(found, key=_rank_of)

    def signal_worker(self, rank: int, sig: int = signal.SIGTERM) -> None:
        worker = next(p for p in self.workers() if _rank_of(p) == rank)
        worker.send_signal(sig)

    def progress(self) -> dict | None:
        try:
            return json.loads(self.progress_path.read_text())
        except (OSError, ValueError):
            return None

    def wait_step(self, step: int, timeout_s: float = 60) -> dict:
        """Wait until the progress file reports ``step`` or later; return that record."""
        def reached() -> bool:
            rec = self.progress()
            return rec is not None and rec["step"] >= step and rec["event"] != "resumed"
        if not proctree.wait_for(reached, timeout_s):
            raise AssertionError(f"{self.name} never reached step {step}:\n{self.tail()}")
        return self.progress()  # type: ignore[return-value]

    def records(self) -> list[dict]:
        """Every JSON log line of the launch (all ranks), in order."""
        return json_lines(self.log_path.read_text(errors="replace"))

    def events(self) -> list[dict]:
        """Rank 0's progress lines, in order."""
        return [r for r in self.records() if r.get("kind") == "progress" and r.get("rank") == 0]

    def exits(self) -> dict[int, dict]:
        """Each rank's "worker exit" line (exit_code, step), by rank."""
        return {r["rank"]: r for r in self.records() if r.get("event") == "worker exit"}

    def tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def json_lines(text: str) -> list[dict]:
    """The JSON lines of a shared log. A record that another writer's output split (a line
    that holds a progress record after other text) fails loudly: the tests count records,
    and a dropped one would read as a lost step."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        elif _holds_a_record(line):
            raise AssertionError(f"a log line was interleaved by another writer: {line!r}")
    return out


def _holds_a_record(line: str) -> bool:
    start = line.find('{"')
    if start < 0:
        return False
    try:
        rec = json.loads(line[start:])
    except ValueError:
        return False
    return isinstance(rec, dict) and (rec.get("kind") == "progress" or "exit_code" in rec)


def _is_worker(proc: psutil.Process, script: str) -> bool:
    try:
        cmd = proc.cmdline()
        return any(part.endswith(script) for part in cmd) and "torch.distributed.run" not in cmd
    except psutil.Error:
        return False


def _rank_of(proc: psutil.Process) -> int:
    try:
        return int(proc.environ().get("RANK", "-1"))
    except psutil.Error:
        return -1


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> float:
    """Seconds until every process in ``procs`` is gone; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still alive after {timeout_s} s: {[p.pid for p in alive]}"
    return time.monotonic() - start


def run_members(member: str, argvs: list[list[str]], timeout_s: float = 60) -> list[dict]:
    """One ``python member *argv`` per rank (a gloo group of them, ``tests/workers``); each
    must exit 0; the JSON object each printed last, by rank."""
    procs = [subprocess.Popen([sys.executable, member, *argv], stdout=subprocess.PIPE, text=True)
             for argv in argvs]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * len(argvs), outs
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]
