"""The torchrun agent the daemon runs: its command line, environment and process.

The command is plain torchrun with ``--rdzv-backend=etcd3``: anything the
daemon adds to the workers' environment (``ELASTICD_*``, defined once in
``elasticd.contract.settings``) a plain torchrun user could set too. The agent gets
a parent-death signal, so a SIGKILLed daemon takes its agent along; workers watch
their parent (trainer's watchdog), and the daemon, as child subreaper, adopts and
kills any worker an agent leaves behind.

etcd credentials never enter the agent's environment (torchrun's workers inherit
it, and /proc/<pid>/environ of every worker would show them): the agent gets
``ELASTICD_ETCD_AUTH_STDIN=1`` and reads one JSON line from its stdin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from elasticd import proctree
from elasticd.config import Config
from elasticd.contract import settings as worker_contract
from elasticd.contract.identity import (
    WORKER_USER_VAR,
    WorkerIdentity,
    launcher_command,
    requested,
    share,
)
from elasticd.contract.settings import ETCD_AUTH_STDIN_VAR, SECRET_VARS, WorkerSettings
from elasticd.warmstart import WarmChild, WarmHost, spawn

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class RunFiles:
    """Per-daemon files shared with the workers."""

    run_dir: Path
    log_dir: Path | None = None
    # Who the workers run as (``[job] worker_user``); None: the daemon's own user.
    workers: WorkerIdentity | None = None

    def make_shared(self, path: Path) -> Path:
        """Make directory ``path`` (if missing) and, with a worker user, open it to the
        workers' group (``identity.share``)."""
        path.mkdir(parents=True, exist_ok=True)
        if self.workers is not None:
            share(path, self.workers)
        return path

    @property
    def progress(self) -> Path:
        return self.run_dir / "progress.json"

    @property
    def stop(self) -> Path:
        return self.run_dir / "stop"

    @property
    def leave(self) -> Path:
        """Exists: our agent joins no further round (``WorkerSettings.leave_file``)."""
        return self.run_dir / "leave"

    @property
    def enter(self) -> Path:
        """Exists: our agent's next round is its own, its workers newcomers
        (``WorkerSettings.enter_file``, ``elasticd.rendezvous.entering``)."""
        return self.run_dir / "enter"

    @property
    def generation(self) -> Path:
        """The generation record for this node's workers (in-place re-forms; the daemon writes)."""
        return self.run_dir / "generation.json"

    @property
    def warm_socket(self) -> Path:
        """The warm-start server's socket (elasticd.warmstart)."""
        return self.run_dir / "warm.sock"

    @property
    def warm_log(self) -> Path:
        return (self.log_dir or self.run_dir) / "warm.log"

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


def torchrun_command(config: Config, nproc: int, log_dir: Path | None = None,
                     warm_socket: Path | None = None) -> list[str]:
    """The agent's command. With ``warm_socket``, each worker is the warm-start client
    (``elasticd.warmstart``: forked by the node's server) instead of a cold interpreter."""
    job = config.job
    python = job.python or sys.executable
    logs = [f"--log-dir={log_dir}"] if log_dir else []
    entry = list(job.entrypoint)
    if warm_socket is not None and warm_capable(config):
        entry = ["--no-python", python, "-m", "elasticd.warmstart", str(warm_socket), *entry]
    elif job.worker_user:   # a cold worker switches users before its interpreter starts
        entry = ["--no-python", *launcher_command(python, entry)]
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
        *entry,
    ]


def warm_capable(config: Config) -> bool:
    """Warm starts are asked for and the entrypoint is a script path (not ``-m module``)."""
    return config.job.warm_start and not config.job.entrypoint[0].startswith("-")


def _rdzv_conf(config: Config) -> str:
    parts = [config.rendezvous.conf_string(), f"key_prefix={config.etcd.key_prefix}",
             f"read_timeout={int(max(config.etcd.timeout_s, 1))}"]
    etcd = config.etcd
    if etcd.ca_cert:
        parts += ["protocol=https", f"ca_cert={etcd.ca_cert}"]
    if etcd.cert:
        parts += [f"ssl_cert={etcd.cert}", f"ssl_cert_key={etcd.key}"]
    return ",".join(parts)


def worker_settings(config: Config, files: RunFiles) -> WorkerSettings:
    """The worker contract this daemon hands to its workers."""
    ckpt, lr = config.checkpoint, config.lr
    return WorkerSettings(
        job_id=config.job.id,
        node_id=config.node.id,
        checkpoint_dir=ckpt.dir,
        # 0 means "not by this measure" in the config; the contract says it by leaving it unset.
        checkpoint_every_steps=ckpt.every_steps or None,
        checkpoint_every_s=ckpt.every_s or None,
        keep_last=ckpt.keep_last,
        lr_rule=lr.rule,
        lr_base_world_size=lr.base_world_size,
        lr_warmup_steps=lr.warmup_steps,
        stop_file=str(files.stop),
        leave_file=str(files.leave),
        enter_file=str(files.enter),
        progress_file=str(files.progress),
        daemon_pid=os.getpid(),
        recovery_mode=config.recovery.mode,
        recovery_bound_s=config.recovery.bound_s,
        reform=config.recovery.reform,
        generation_file=str(files.generation),
        secret_file=config.recovery.secret_file or None,
        nonfinite_loss_limit=config.supervisor.nonfinite_loss_limit,
    )


@dataclass(frozen=True)
class EtcdAuth:
    """etcd credentials for the agent's rendezvous handler, handed over on its stdin."""

    user: str
    password: str = dataclasses.field(repr=False)  # never in a log line

    def stdin_line(self) -> bytes:
        return worker_contract.encode_etcd_auth(self.user, self.password)


def etcd_auth(config: Config) -> EtcdAuth | None:
    """The credentials to pass to ``AgentProcess(etcd_auth=...)``; None without etcd auth."""
    if not config.etcd.user:
        return None
    return EtcdAuth(config.etcd.user, config.etcd.password or "")


def worker_env(config: Config, files: RunFiles, base: dict[str, str] | None = None) -> dict[str, str]:
    """The agent's environment: ours plus the ``ELASTICD_*`` contract with the workers."""
    env = dict(os.environ if base is None else base)
    # systemd's notify/watchdog contract is the daemon's alone: a worker writing to
    # NOTIFY_SOCKET could report READY or feed the watchdog on our behalf.
    for var in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        env.pop(var, None)
    # The daemon's own environment may carry the credentials (config overrides) or stale
    # contract variables (a setting the config leaves unset must not leak through).
    for var in (*SECRET_VARS, ETCD_AUTH_STDIN_VAR, WORKER_USER_VAR,
                *worker_contract.contract_env_names()):
        env.pop(var, None)
    env.update(worker_settings(config, files).to_env())
    if files.workers is not None:   # read by each worker's first step (identity.become_worker)
        env[WORKER_USER_VAR] = files.workers.encode()
    env.update({
        # Publish MASTER_ADDR/PORT afresh every round (see rendezvous/handler.py).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(files.tmp),
    })
    if config.etcd.user:
        env[ETCD_AUTH_STDIN_VAR] = "1"  # the credentials follow on stdin (AgentProcess.start)
    return env


def prune_log_dirs(parent: Path, keep: int = 5) -> None:
    """torchrun makes one log dir per agent start: keep only the newest ``keep``."""
    if not parent.is_dir():
        return
    dirs = sorted((d for d in parent.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for old in dirs[:-keep] if keep else dirs:
        shutil.rmtree(old, ignore_errors=True)


AGENT_LOG_MAX_BYTES = 64 << 20
AGENT_LOG_KEEP = 3


def rotate_log(path: Path, max_bytes: int = AGENT_LOG_MAX_BYTES, keep: int = AGENT_LOG_KEEP) -> bool:
    """Rotate ``path`` to ``path.1`` (``.1`` to ``.2``, ...) when larger than ``max_bytes``.

    Called before an agent starts, so no process is writing the file. Keeps ``keep``
    old files; returns whether it rotated. A failure is logged, never raised: a log
    that cannot be rotated must not stop training.
    """
    try:
        if not path.exists() or path.stat().st_size <= max_bytes:
            return False
        for i in range(keep, 0, -1):
            older = path.with_name(f"{path.name}.{i}")
            if i == keep:
                older.unlink(missing_ok=True)
            else:
                newer = path.with_name(f"{path.name}.{i + 1}")
                if older.exists():
                    older.replace(newer)
        if keep > 0:
            path.replace(path.with_name(f"{path.name}.1"))
        else:
            path.unlink()
        return True
    except OSError as exc:
        log.warning("agent log not rotated", path=str(path), error=str(exc))
        return False


class AgentProcess:
    """One life of the torchrun agent: start, watch, stop, and kill its workers."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path,
                 clock: object = None, *, etcd_auth: EtcdAuth | None = None,
                 log_max_bytes: int = AGENT_LOG_MAX_BYTES, log_keep: int = AGENT_LOG_KEEP,
                 warm: WarmHost | None = None) -> None:
        """``warm``: the node's warm-start server; when it is ready the agent is forked
        there (``python -m`` commands of its interpreter only), else started cold."""
        # ``clock`` is accepted (and ignored) for existing callers: it only timed the
        # removed ``started_at``.
        del clock
        if (env.get(ETCD_AUTH_STDIN_VAR) == "1") != (etcd_auth is not None):
            # An agent told to read credentials that never come (or given credentials it
            # will not read) would fail its rendezvous far from the cause.
            raise ValueError(
                f"{ETCD_AUTH_STDIN_VAR}={env.get(ETCD_AUTH_STDIN_VAR)!r} in the agent env but "
                f"etcd_auth is {'missing' if etcd_auth is None else 'given'}: build the env "
                "with worker_env and pass etcd_auth=agent.etcd_auth(config)"
            )
        self._command = command
        self._env = env
        self._log_path = log_path
        self._etcd_auth = etcd_auth
        self._log_max_bytes = log_max_bytes
        self._log_keep = log_keep
        self._warm = warm
        self.proc: subprocess.Popen | WarmChild | None = None
        self.started_warm = False

    def start(self) -> int:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(self._env["TMPDIR"])
        shutil.rmtree(tmp, ignore_errors=True)  # the previous agent's leftovers
        tmp.mkdir(parents=True, exist_ok=True)
        workers = requested(self._env)
        if workers is not None:   # the workers' TMPDIR too: theirs to write
            share(tmp, workers)
        if rotate_log(self._log_path, self._log_max_bytes, self._log_keep):
            log.info("agent log rotated", path=str(self._log_path), keep=self._log_keep)
        self.proc = self._start_warm()
        self.started_warm = self.proc is not None
        if self.proc is None:
            # The parent-death signal is set by the child after exec (setpriv): Popen's
            # preexec_fn would run Python between fork and exec while our threads run.
            command = proctree.with_parent_death_signal(self._command)
            stdin = subprocess.PIPE if self._etcd_auth else subprocess.DEVNULL
            with open(self._log_path, "ab") as out:
                self.proc = subprocess.Popen(command, env=self._env, stdout=out,
                                             stderr=subprocess.STDOUT, stdin=stdin)
        if self._etcd_auth is not None:
            self._send_auth(self._etcd_auth)
        return self.proc.pid

    def _start_warm(self) -> WarmChild | None:
        """The agent forked by the ready warm-start server (its ``import torch``, 2.8 s
        here, already done), or None: start it cold. Its parent-death signal is the
        server's child's (``run_worker``), and the server SIGKILLs it when we die."""
        warm, command = self._warm, self._command
        if warm is None or command[:2] != [warm.python, "-m"] or warm.state() != "ready":
            return None
        reader, writer = os.pipe() if self._etcd_auth else (os.open(os.devnull, os.O_RDONLY), -1)
        stdin = os.fdopen(writer, "wb") if writer >= 0 else None
        try:
            with open(self._log_path, "ab") as out:
                return spawn(warm.socket_path, command[1:], self._env,
                             [reader, out.fileno(), out.fileno()], stdin=stdin)
        except (OSError, ValueError) as exc:
            log.warning("the warm-start server did not fork the agent; starting it cold",
                        error=str(exc))
            if stdin is not None:
                stdin.close()
            return None
        finally:
            os.close(reader)

    def _send_auth(self, auth: EtcdAuth) -> None:
        # One short line fits in the pipe buffer, so this never blocks on a slow reader.
        try:
            self.proc.stdin.write(auth.stdin_line())
            self.proc.stdin.close()
        except OSError as exc:  # the agent died at once; its exit code tells the daemon
            log.warning("etcd credentials not delivered to the agent", error=str(exc))
            with contextlib.suppress(OSError):
                self.proc.stdin.close()

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


def torch_restart_count(workers: list[psutil.Process]) -> int | None:
    """The ``TORCHELASTIC_RESTART_COUNT`` torch started ``workers`` with: its count of
    failure restarts (None if unreadable). A restart for a membership change keeps it."""
    for worker in workers:
        with contextlib.suppress(psutil.Error, KeyError, ValueError):
            return int(worker.environ()["TORCHELASTIC_RESTART_COUNT"])
    return None
