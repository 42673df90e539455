"""Ownership of process trees: the daemon (and the test suite) kill what they start.

torchrun starts its workers in their own sessions, so killing an agent's process
group leaves them running. Two mechanisms close that gap:

* ``become_subreaper()`` makes this process the child subreaper (Linux
  PR_SET_CHILD_SUBREAPER): descendants orphaned by a dead agent are re-parented
  to us instead of to init, so ``descendants()`` still finds them.
* ``with_parent_death_signal(command)`` prefixes a command so that the kernel
  SIGKILLs the child when its parent dies, so a SIGKILLed daemon does not leave an
  agent. It is set in the child after exec (util-linux ``setpriv``, else a tiny
  Python wrapper), never in a ``preexec_fn``: that runs Python between fork and
  exec, which is unsafe while the parent has other threads (a lock held by
  another thread at fork stays locked forever in the child).

``pid_alive`` (``elasticd.contract.pids``) is the one liveness test of the project (daemon, trainer watchdog,
checkpoint cleanup): a zombie is dead.
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

from elasticd.contract.pids import pid_alive

log = structlog.get_logger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def become_subreaper() -> None:
    """Adopt every orphaned descendant of this process (Linux only)."""
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)


SETPRIV = "/usr/bin/setpriv"

# The fallback when setpriv is missing: a fresh interpreter (no threads, no locks
# inherited) sets the signal, then becomes the real command. argv: parent pid, command.
# The parent check closes the race of a parent that died before prctl ran.
_PDEATHSIG_EXEC = (
    "import ctypes,os,sys\n"
    "if ctypes.CDLL(None,use_errno=True).prctl(1,9,0,0,0)!=0:"
    "sys.exit('prctl(PR_SET_PDEATHSIG) failed: errno %d'%ctypes.get_errno())\n"
    "if os.getppid()!=int(sys.argv[1]):os._exit(1)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


# After setpriv's prctl, a shell checks that the parent is still the one that started us
# ($PPID is read at shell start, after the prctl), then becomes the command. This closes
# the race of a parent dying between fork and prctl (measured: a daemon SIGKILLed right
# after Popen returned left its agent running). argv: $0 = the parent pid, then the command.
_PARENT_CHECK_SH = 'test "$PPID" = "$0" || exit 1; exec "$@"'


def with_parent_death_signal(command: list[str], setpriv: str | None = None,
                             python: str | None = None, parent_pid: int | None = None
                             ) -> list[str]:
    """``command`` prefixed so that it is SIGKILLed when the process that starts it dies.

    The signal is set in the child after exec (util-linux ``setpriv``, else a fresh
    Python interpreter), never between fork and exec. Either way the child then checks
    that its parent is still ``parent_pid`` (default: this process) and exits 1 if not,
    so a parent that died before the signal was set does not leave the command running.
    The kernel ties PR_SET_PDEATHSIG to the parent *thread* that forked: start the child
    from a long-lived thread (the daemon's main loop does).
    ``setpriv``: the tool's path (default ``SETPRIV``; "" forces the Python fallback).
    """
    parent = str(parent_pid or os.getpid())
    tool = SETPRIV if setpriv is None else setpriv
    if tool and os.access(tool, os.X_OK) and os.access("/bin/sh", os.X_OK):
        return [tool, "--pdeathsig", "KILL", "--", "/bin/sh", "-c", _PARENT_CHECK_SH, parent,
                *command]
    import sys

    return [python or sys.executable, "-I", "-S", "-c", _PDEATHSIG_EXEC, parent, *command]


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """All live descendants of ``pid`` (default: this process), deepest first."""
    try:
        root = psutil.Process(pid or os.getpid())
        kids = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in reversed(kids) if pid_alive(p)]


def kill_processes(procs: Iterable[psutil.Process], grace_s: float = 0.0) -> list[psutil.Process]:
    """SIGTERM (if ``grace_s`` > 0) then SIGKILL ``procs``; return those still alive.

    Processes are signalled all at once, so a group shuts down in one grace
    period rather than one per process.
    """
    procs = [p for p in procs if pid_alive(p)]
    if grace_s > 0:
        _signal_all(procs, signal.SIGTERM)
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    _signal_all(procs, signal.SIGKILL)
    _, alive = psutil.wait_procs(procs, timeout=5)
    return [p for p in alive if pid_alive(p)]


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
