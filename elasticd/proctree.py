"""Ownership of process trees: the daemon (and the test suite) kill what they start.

torchrun starts its workers in their own sessions, so killing an agent's process
group leaves them running. Two mechanisms close that gap:

* ``become_subreaper()`` makes this process the child subreaper (Linux
  PR_SET_CHILD_SUBREAPER): descendants orphaned by a dead agent are re-parented
  to us instead of to init, so ``descendants()`` still finds them.
* ``parent_death_signal()`` is a ``preexec_fn`` that asks the kernel to SIGKILL
  the child when its parent dies, so a SIGKILLed daemon does not leave an agent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable

import psutil
import structlog

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def become_subreaper() -> None:
    """Adopt every orphaned descendant of this process (Linux only)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """``preexec_fn`` for Popen: the child receives ``sig`` when its parent dies."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """All live descendants of ``pid`` (default: this process), deepest first."""
    try:
        root = psutil.Process(pid or os.getpid())
        kids = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in reversed(kids) if _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_processes(procs: Iterable[psutil.Process], grace_s: float = 0.0) -> list[psutil.Process]:
    """SIGTERM (if ``grace_s`` > 0) then SIGKILL ``procs``; return those still alive.

    Processes are signalled all at once, so a group shuts down in one grace
    period rather than one per process.
    """
    procs = [p for p in procs if _alive(p)]
    if grace_s > 0:
        _signal_all(procs, signal.SIGTERM)
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    _signal_all(procs, signal.SIGKILL)
    _, alive = psutil.wait_procs(procs, timeout=5)
    return [p for p in alive if _alive(p)]


def _signal_all(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)


def kill_tree(pid: int, grace_s: float = 0.0) -> list[psutil.Process]:
    """Kill ``pid`` and every descendant; return the processes that survived.

    The tree is captured before anything is signalled: once a parent dies its
    children are re-parented and could no longer be found from it.
    """
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    tree = [*descendants(pid), root]
    return kill_processes(tree, grace_s)


def reap_children() -> None:
    """Collect exited children (zombies) without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_for(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until it returns truthy or ``timeout_s`` passes (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
