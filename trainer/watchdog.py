"""The orphan watchdog: a worker must not outlive its torchrun agent or the daemon.

torchrun starts workers in their own sessions, so a SIGKILLed agent or daemon
leaves them running (and holding the GPU, the port, the checkpoint directory).
A daemon thread polls twice a second and ``os._exit``s the worker when

* its parent (the torchrun agent) is gone: ``os.getppid()`` differs from its value
  at start, because orphans are re-parented to init or to a subreaper; or
* ``ELASTICD_DAEMON_PID`` is set and that process is gone (or a zombie).

Works under plain torchrun too (the parent check needs no daemon).

The thread needs the GIL, and a C++ call can hold it while blocked (measured: a
gloo process-group destructor after a peer died). So ``start`` also asks the kernel
for SIGKILL when the parent dies (``PR_SET_PDEATHSIG``, Linux), which needs no
cooperation from the process. The kernel ties that signal to the parent *thread*
that started us; torchrun's agent starts workers from its main thread. Pass
``parent_death_signal=False`` when a launcher starts workers from short-lived threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from collections.abc import Callable

import structlog

# The project's one liveness test (a zombie daemon is dead); re-exported here.
from elasticd.contract.pids import pid_alive
from trainer.exitcodes import ORPHAN_EXIT_CODE

__all__ = ["OrphanWatchdog", "pid_alive"]

log = structlog.get_logger(__name__)


class OrphanWatchdog:
    """Exit the process when its parent or the daemon dies; see the module docstring."""

    def __init__(
        self,
        daemon_pid: int | None = None,
        interval_s: float = 0.25,
        exit_code: int = ORPHAN_EXIT_CODE,
        getppid: Callable[[], int] = os.getppid,
        is_alive: Callable[[int], bool] = pid_alive,
        exit_fn: Callable[[int], object] = os._exit,
        parent_death_signal: bool = True,
    ) -> None:
        self.daemon_pid = daemon_pid
        self.interval_s = interval_s
        self.exit_code = exit_code
        self._getppid = getppid
        self._is_alive = is_alive
        self._exit = exit_fn
        self.parent_death_signal = parent_death_signal
        self.start_ppid = getppid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def orphaned(self) -> str | None:
        """Why this process is orphaned, or None while its parent and daemon live."""
        ppid = self._getppid()
        if ppid != self.start_ppid:
            return f"parent {self.start_ppid} is gone (re-parented to {ppid})"
        if self.daemon_pid is not None and not self._is_alive(self.daemon_pid):
            return f"daemon {self.daemon_pid} is gone"
        return None

    def start(self) -> OrphanWatchdog:
        """Start the polling thread (a daemon thread: it never blocks interpreter exit)."""
        if self.parent_death_signal:
            _set_parent_death_signal(signal.SIGKILL)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="orphan-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            reason = self.orphaned()
            if reason:
                log.error("orphaned worker exits", reason=reason, exit_code=self.exit_code)
                self._exit(self.exit_code)
                return


def _set_parent_death_signal(sig: int) -> None:
    """Best effort: a kernel without prctl (non-Linux) leaves only the polling thread."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        log.warning("PR_SET_PDEATHSIG unavailable; relying on the polling thread only")


_PR_SET_PDEATHSIG = 1
