"""What a node does before its daemon imports torch: the run directory and the warm-start
server.

``elasticd.daemon`` imports torch (the rendezvous state's classes): 3.7 s here on an idle
machine, about 5 s on a node whose cores the job keeps busy. The warm-start server
(``elasticd.warmstart``) imports torch, dynamo and the trainer again (4.4 s idle), and a
newcomer's workers can start only once it has. Started from ``_connect``, after the
daemon's own imports, the server's were the longest part of a join: measured, 15.0 s from
the newcomer's daemon start to its first step, the server ready 9.5 s after it was
started. Started here, first thing, its imports run beside the daemon's instead of after
them. This module imports nothing that imports torch (``tests/test_layers.py``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import structlog

from elasticd.agent import RunFiles, warm_capable, worker_env
from elasticd.config import Config, check_worker_user
from elasticd.contract.identity import WorkerIdentity, worker_can
from elasticd.warmstart import WarmHost

log = structlog.get_logger(__name__)


@dataclass
class Prestart:
    """The run files and the warm host (None: warm starts off) a daemon is built with."""

    files: RunFiles
    temp_run_dir: bool          # made up here (no ``[node] run_dir``): kept and said so at the end
    warm_host: WarmHost | None

    def start_warm(self, config: Config) -> None:
        """Start the warm-start server unless it runs. From the thread that runs the
        daemon's loop: its parent-death signal is tied to the thread that started it."""
        if self.warm_host is not None and self.warm_host.proc is None:
            self.warm_host.start(worker_env(config, self.files))


def prepare(config: Config) -> Prestart:
    """The node's run directory (made when ``[node] run_dir`` is unset) and its warm host,
    not yet started. With ``[job] worker_user`` (checked here: ``ConfigError``) the run
    directory and torchrun's log directory are opened to the workers' group."""
    workers = check_worker_user(config)
    if workers is not None:
        _say_what_the_workers_cannot_import(workers)
    temp = not config.node.run_dir
    run_dir = config.node.run_dir or tempfile.mkdtemp(prefix=f"elasticd-{config.node.id}-")
    log_dir = Path(config.node.log_dir) if config.node.log_dir else None
    files = RunFiles(Path(run_dir), log_dir, workers)
    files.make_shared(files.run_dir)
    if workers is not None:   # torchrun's error files are written by the workers
        files.make_shared(files.torchrun_logs)
    warm = WarmHost(config.job.python or sys.executable, files.warm_socket, files.warm_log,
                    config.job.warm_imports) if warm_capable(config) else None
    return Prestart(files, temp, warm)


def _say_what_the_workers_cannot_import(workers: WorkerIdentity) -> None:
    """A warm worker imports, as the worker user, what the server had not imported yet,
    from the daemon's ``sys.path``: say which of its directories that user cannot read
    (an interpreter under a private home, say), where a later import would fail."""
    closed = [p for p in sys.path if p and os.path.isdir(p) and not worker_can(workers, p, "rx")]
    if closed:
        log.warning("the workers' user cannot read these import directories; a module "
                    "imported from them after the switch fails: install the interpreter "
                    "and packages where that user can read them (e.g. /opt/elasticd/venv)",
                    uid=workers.uid, directories=closed)
