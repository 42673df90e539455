"""The daemon is the child subreaper of its tree: every orphan re-parented to it must be
reaped (else it stays a zombie for the daemon's lifetime), and the agent, which its own
Popen reaps, must be left alone so its exit code is not lost.

The unit tests run ``reap_orphans`` in the pytest process, a child subreaper too
(tests/conftest.py); the process test runs a real daemon whose workers leave orphans.
"""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from elasticd import proctree
from elasticd.observer import reap_orphans
from tests.daemon_nodes import DaemonNode, stop_nodes, wait_for


def _zombie_children(of: psutil.Process | None = None, skip: frozenset[int] = frozenset()) -> list[int]:
    out = []
    for child in (of or psutil.Process()).children():
        try:
            if child.pid not in skip and child.status() == psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _orphan_zombie(seconds: float = 0.3) -> int:
    """A grandchild whose parent exits at once: re-parented to us, a zombie once it exits."""
    parent = subprocess.Popen(["sh", "-c", f"sleep {seconds} >/dev/null & echo $!; exit 0"],
                              stdout=subprocess.PIPE, text=True)
    out, _ = parent.communicate(timeout=10)
    assert parent.returncode == 0
    pid = int(out.strip())
    assert psutil.Process(pid).ppid() == psutil.Process().pid, "the orphan was not re-parented to us"
    assert proctree.wait_for(lambda: _is_zombie(pid), 10), f"orphan {pid} never became a zombie"
    return pid


def test_reap_orphans_reaps_an_adopted_zombie():
    pid = _orphan_zombie()
    reaped = reap_orphans(keep=None)
    assert pid in reaped
    assert not psutil.pid_exists(pid) or not _is_zombie(pid)
    assert _zombie_children() == []
    assert reap_orphans(keep=None) == []   # nothing left to reap


def test_reap_orphans_leaves_the_kept_child_to_its_popen():
    kept = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    assert proctree.wait_for(lambda: _is_zombie(kept.pid), 20), "the kept child never exited"
    orphan = _orphan_zombie()
    reaped = reap_orphans(keep=kept.pid)
    assert orphan in reaped and kept.pid not in reaped
    assert _is_zombie(kept.pid), "the kept child was reaped: its Popen lost the exit code"
    assert _zombie_children(skip=frozenset({kept.pid})) == []
    # Reaped by anyone else, Popen would report 0 (ECHILD), not the real status.
    assert kept.wait(timeout=5) == 7


ORPHAN_MAKER = """\
import pathlib, subprocess, sys, time
out = pathlib.Path(sys.argv[1])
for i in range({count}):
    # sh exits at once; its background sleep is orphaned to the nearest subreaper
    subprocess.Popen(["sh", "-c", "sleep 0.2 &"]).wait()
    (out / "spawned").write_text(str(i + 1))
    time.sleep(0.1)
(out / "done").write_text("")
while True:
    time.sleep(1)
"""
ORPHANS = 30


@pytest.fixture
def node(tmp_path, job_id, etcd_server):
    script = tmp_path / "orphans.py"
    script.write_text(ORPHAN_MAKER.format(count=ORPHANS))
    node = DaemonNode("a", etcd_server.endpoint, job_id, tmp_path,
                      {"entrypoint": [str(script), str(tmp_path)], "max_nodes": 1})
    yield node
    stop_nodes([node])


@pytest.mark.slow
def test_daemon_reaps_the_orphans_its_workers_leave(node, tmp_path):
    node.start()
    daemon = psutil.Process(node.proc.pid)
    adopted: set[int] = set()
    most_zombies = 0

    def watch() -> bool:
        nonlocal most_zombies
        for child in daemon.children():
            try:
                if child.name() == "sleep":
                    adopted.add(child.pid)
            except psutil.NoSuchProcess:
                pass
        most_zombies = max(most_zombies, len(_zombie_children(daemon)))
        return (tmp_path / "done").exists()

    wait_for(watch, 60, "the workers to spawn their orphans", [node])
    assert node.running(), node.log_tail()
    assert int((tmp_path / "spawned").read_text()) == ORPHANS
    # The orphans were re-parented to the daemon (else this test proves nothing) ...
    assert len(adopted) >= 3, f"the daemon adopted only {sorted(adopted)}"
    # ... and reaped within a cycle or two, never piling up.
    assert most_zombies <= 6, f"{most_zombies} zombies at once under the daemon"
    # The last sleeps (0.2 s) end; the daemon's loop ticks every 0.1 s (slack for a busy box).
    wait_for(lambda: not _zombie_children(daemon), 5, "no zombie orphans under the daemon", [node])
    assert node.running(), node.log_tail()
