"""Is a process alive: the one liveness test of the project (the daemon's process tree,
the trainer's orphan watchdog, checkpoint retention's stale-lock check). Torch-free."""

from __future__ import annotations

import psutil


def pid_alive(pid: int | psutil.Process) -> bool:
    """True while ``pid`` runs; False when it is gone or a zombie (dead but unreaped).

    A ``psutil.Process`` is also checked for pid reuse (a new process with the same
    pid is not the one that was captured). A process we may not inspect exists, so
    it counts as alive.
    """
    if isinstance(pid, psutil.Process):
        proc = pid
        try:
            if not proc.is_running():
                return False
        except psutil.Error:
            return False
    else:
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            return False  # 0 and negatives name process groups for kill(), not a process
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return False
        except psutil.AccessDenied:
            return True
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
