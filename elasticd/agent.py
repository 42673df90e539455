"""The torchrun agent the daemon runs: its command line, environment and process.

The command is plain torchrun with ``--rdzv-backend=etcd3``: anything the
daemon adds to the workers' environment (``ELASTICD_*``) a plain torchrun user
could set too. The agent gets a parent-death signal, so a SIGKILLed daemon
takes its agent along; workers watch their parent (trainer's watchdog), and the
daemon, as child subreaper, adopts and kills any worker an agent leaves behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from elasticd import proctree
from elasticd.config import Config

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RunFiles:
    """Per-daemon files shared with the workers."""

    run_dir: Path
    log_dir: Path | None = None

    @property
    def progress(self) -> Path:
        return self.run_dir / "progress.json"

    @property
    def stop(self) -> Path:
        return self.run_dir / "stop"

    @property
    def tmp(self) -> Path:
        """TMPDIR of the agent and workers: torchrun leaves a torchelastic_* dir per start."""
        return self.run_dir / "tmp"

    @property
    def torchrun_logs(self) -> Path:
        """torchrun's --log-dir: the workers' error files (tracebacks of failed workers)."""
        return (self.log_dir or self.run_dir) / "torchrun"

    @property
    def agent_log(self) -> Path:
        return (self.log_dir or self.run_dir) / "agent.log"


def torchrun_command(config: Config, nproc: int, log_dir: Path | None = None) -> list[str]:
    job = config.job
    python = job.python or sys.executable
    logs = [f"--log-dir={log_dir}"] if log_dir else []
    return [
        python, "-m", "torch.distributed.run",
        "--rdzv-backend=etcd3",
        f"--rdzv-endpoint={config.etcd.rdzv_endpoint()}",
        f"--rdzv-id={job.id}",
        f"--rdzv-conf={_rdzv_conf(config)}",
        f"--nnodes={job.min_nodes}:{job.max_nodes}",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={config.supervisor.worker_restarts}",
        f"--monitor-interval={config.supervisor.monitor_interval_s}",
        f"--local-addr={config.node.addr}",
        *logs,
        *job.entrypoint,
    ]


def _rdzv_conf(config: Config) -> str:
    parts = [config.rendezvous.conf_string(), f"key_prefix={config.etcd.key_prefix}",
             f"read_timeout={int(max(config.etcd.timeout_s, 1))}"]
    etcd = config.etcd
    if etcd.ca_cert:
        parts += ["protocol=https", f"ca_cert={etcd.ca_cert}"]
    if etcd.cert:
        parts += [f"ssl_cert={etcd.cert}", f"ssl_cert_key={etcd.key}"]
    return ",".join(parts)


def worker_env(config: Config, files: RunFiles, base: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment: ours plus the ``ELASTICD_*`` contract with the workers."""
    env = dict(os.environ if base is None else base)
    # systemd's notify/watchdog contract is the daemon's alone: a worker writing to
    # NOTIFY_SOCKET could report READY or feed the watchdog on our behalf.
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(var, None)
    ckpt, lr = config.checkpoint, config.lr
    env.update({
        "ELASTICD_JOB_ID": config.job.id,
        "ELASTICD_NODE_ID": config.node.id,
        "ELASTICD_CHECKPOINT_DIR": ckpt.dir,
        "ELASTICD_KEEP_LAST": str(ckpt.keep_last),
        "ELASTICD_LR_RULE": lr.rule,
        "ELASTICD_LR_BASE_WORLD_SIZE": str(lr.base_world_size),
        "ELASTICD_LR_WARMUP_STEPS": str(lr.warmup_steps),
        "ELASTICD_STOP_FILE": str(files.stop),
        "ELASTICD_PROGRESS_FILE": str(files.progress),
        "ELASTICD_DAEMON_PID": str(os.getpid()),
        # Publish MASTER_ADDR/PORT afresh every round (see rendezvous/handler.py).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(files.tmp),
    })
    # 0 means "not by this measure": leave the variable unset rather than pass 0.
    if ckpt.every_steps:
        env["ELASTICD_CHECKPOINT_EVERY_STEPS"] = str(ckpt.every_steps)
    if ckpt.every_s:
        env["ELASTICD_CHECKPOINT_EVERY_S"] = str(ckpt.every_s)
    if config.etcd.user:
        env["ELASTICD_ETCD_USER"] = config.etcd.user
        env["ELASTICD_ETCD_PASSWORD"] = config.etcd.password or ""
    return env


def prune_log_dirs(parent: Path, keep: int = 5) -> None:
    """torchrun makes one log dir per agent start: keep only the newest ``keep``."""
    if not parent.is_dir():
        return
    dirs = sorted((d for d in parent.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for old in dirs[:-keep] if keep else dirs:
        shutil.rmtree(old, ignore_errors=True)


class AgentProcess:
    """One life of the torchrun agent: start, watch, stop, and kill its workers."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path,
                 clock=time.monotonic) -> None:
        self._command = command
        self._env = env
        self._log_path = log_path
        self._clock = clock
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None

    def start(self) -> int:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(self._env["TMPDIR"])
        shutil.rmtree(tmp, ignore_errors=True)  # the previous agent's leftovers
        tmp.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "ab") as out:
            self.proc = subprocess.Popen(self._command, env=self._env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=proctree.parent_death_signal)
        self.started_at = self._clock()
        return self.proc.pid

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def workers(self, direct: bool = False) -> list[psutil.Process]:
        """The agent's workers (``direct``: only its children, not their helpers)."""
        if not self.running():
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=not direct)
        except psutil.NoSuchProcess:
            return []

    def kill_workers(self) -> int:
        """SIGKILL the workers (not the agent): the agent then re-rendezvouses."""
        workers = self.workers()
        proctree.kill_processes(workers)
        return len(workers)

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM the agent (it forwards SIGTERM to its workers), then SIGKILL the tree."""
        if self.proc is None:
            return None
        survivors = proctree.kill_tree(self.proc.pid, grace_s=grace_s)
        if survivors:
            log.error("processes survived SIGKILL", pids=[p.pid for p in survivors])
        return self.proc.wait()
