"""The orphan watchdog: a worker exits when its parent or the daemon dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from elasticd import proctree
from trainer.exitcodes import ORPHAN_EXIT_CODE
from trainer.watchdog import OrphanWatchdog, pid_alive


def test_orphaned_when_reparented_or_daemon_gone():
    ppid = [100]
    alive = {7: True}
    dog = OrphanWatchdog(daemon_pid=7, getppid=lambda: ppid[0], is_alive=lambda p: alive[p])
    assert dog.orphaned() is None
    alive[7] = False
    assert "daemon 7 is gone" in dog.orphaned()
    alive[7] = True
    ppid[0] = 1
    assert "parent 100 is gone" in dog.orphaned()


def test_thread_exits_with_the_orphan_code():
    exits = []
    ppid = [100]
    dog = OrphanWatchdog(interval_s=0.01, getppid=lambda: ppid[0], exit_fn=exits.append,
                         parent_death_signal=False)  # not on pytest itself
    dog.start()
    ppid[0] = 1
    assert proctree.wait_for(lambda: exits, 2)
    assert exits == [ORPHAN_EXIT_CODE]


def test_pid_alive_treats_a_zombie_as_dead():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert proctree.wait_for(lambda: psutil.Process(child.pid).status() == "zombie", 10)
    assert not pid_alive(child.pid)
    assert not pid_alive(psutil.Process(child.pid))
    child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(psutil.Process().pid)


def test_pid_alive_live_dead_and_invalid_pids():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(child.pid) and pid_alive(psutil.Process(child.pid))
        assert pid_alive(1)  # init: alive even where we may not signal or inspect it
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)  # dead and reaped
    for invalid in (0, -1, True):
        assert not pid_alive(invalid)  # kill(0) / kill(-1) would name process groups


def test_one_pid_alive_for_daemon_watchdog_and_checkpoint_cleanup():
    from checkpointing import retention

    assert pid_alive is proctree.pid_alive is retention.pid_alive
    assert retention.StalePolicy.__dataclass_fields__["alive"].default is proctree.pid_alive


# A "torchrun agent" that starts a "worker" in its own session, prints its pid, then sleeps.
_AGENT = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    print(worker.pid, flush=True)
    time.sleep(60)
""")
_WORKER = textwrap.dedent("""
    import time
    from trainer.watchdog import OrphanWatchdog
    OrphanWatchdog(daemon_pid={daemon}, parent_death_signal={pdeathsig}).start()
    time.sleep(60)
""")


def _start(daemon_pid: int | None, pdeathsig: bool) -> tuple[subprocess.Popen, psutil.Process]:
    worker = _WORKER.format(daemon=daemon_pid, pdeathsig=pdeathsig)
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, worker], stdout=subprocess.PIPE,
                             text=True)
    worker = psutil.Process(int(agent.stdout.readline()))
    time.sleep(0.5)  # let the worker import and start its watchdog
    assert worker.is_running()
    return agent, worker


@pytest.mark.parametrize("pdeathsig, code", [(True, -signal.SIGKILL), (False, ORPHAN_EXIT_CODE)])
def test_worker_exits_within_a_second_of_its_agents_sigkill(pdeathsig, code):
    """The kernel's parent-death signal is first; the polling thread alone also does it."""
    agent, worker = _start(None, pdeathsig)
    agent.kill()
    agent.wait()
    started = time.monotonic()
    assert worker.wait(5) == code  # the subreaper (pytest) adopted it
    assert time.monotonic() - started < 1.5


def test_worker_exits_within_a_second_of_the_daemons_death():
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    agent, worker = _start(daemon.pid, pdeathsig=True)
    try:
        daemon.kill()  # left unreaped for a while: a zombie daemon counts as dead
        started = time.monotonic()
        assert proctree.wait_for(lambda: not worker.is_running()
                                 or worker.status() == "zombie", 5)
        assert time.monotonic() - started < 1.5
        assert agent.poll() is None  # the agent lives: it was the daemon check
    finally:
        daemon.wait()
        proctree.kill_tree(agent.pid)
        agent.wait()
