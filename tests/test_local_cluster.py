"""The local-cluster harness itself: whatever happens in the block, every process the
cluster started is gone when it ends (orphans and stopped processes included), and
nothing it did not start is touched."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest

from elasticd import proctree
from elasticd.lab.local_cluster import AllreduceNode, latest, local_cluster, wait_for

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_an_error_in_the_block_still_kills_everything_it_started(tmp_path, job_id):
    bystander = subprocess.Popen(["sleep", "120"])   # older than the cluster: not its to kill
    tree: list[psutil.Process] = []
    try:
        with pytest.raises(RuntimeError, match="the test failed here"), \
                local_cluster(tmp_path / "cluster") as cluster:
            node = cluster.torchrun("solo", job_id, kind=AllreduceNode, nnodes="1", step_sleep=0.05)
            wait_for(lambda: latest(cluster.root, "solo"), 120, "the first step", [node])
            tree = node.tree()
            workers = node.workers()
            assert len(tree) >= 2 and workers, tree
            # The worst case for cleanup: the agent dies alone, its worker is orphaned
            # (re-parented to this subreaper) and frozen.
            psutil.Process(node.proc.pid).kill()
            node.proc.wait()
            for worker in workers:
                worker.send_signal(signal.SIGSTOP)
            etcd = psutil.Process(cluster.etcd.proc.pid)
            raise RuntimeError("the test failed here")
        proctree.reap_children()
        assert not [p for p in tree if _alive(p)], "a process of the node survived"
        assert not [p for p in [etcd] if _alive(p)], "the cluster's etcd survived"
        assert cluster.leftover == []
        assert bystander.poll() is None, "the cluster killed a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()


# -- a harness whose process group becomes orphaned (started with nohup ... &) -------------

_HARNESS = r"""
import dataclasses, pathlib, signal, sys, time
from elasticd.lab.local_cluster import Node

@dataclasses.dataclass
class Sleeper(Node):
    def command(self):
        # Notes a SIGHUP it receives (as a daemon's reload would), else sleeps.
        return [sys.executable, "-c", "import signal, sys, time\n"
                "signal.signal(signal.SIGHUP, lambda *a: open(sys.argv[1], 'a').write('hup'))\n"
                "time.sleep(30)", str(self.root / f"{self.name}.hup")]

    @property
    def log_path(self):
        return self.root / f"{self.name}.log"

root = pathlib.Path(sys.argv[1])
a, b = Sleeper("a", "", "j", root).start(), Sleeper("b", "", "j", root).start()
time.sleep(1.0)
b.signal_tree(signal.SIGSTOP)                  # a frozen node (node-stop)
(root / "frozen").touch()
time.sleep(2.0)                                # meanwhile the shell that started us exits
status = b.tree()[0].status()
for n in (a, b):
    n.signal_tree(signal.SIGKILL)
    n.signal_tree(signal.SIGCONT)
    n.proc.wait()
(root / "result").write_text(status)
"""

# The shell: starts the harness in a process group of its own (as `set -m` does for a
# background job), waits until a node is frozen, and exits: the harness' group is then
# orphaned (its only link to the session was this shell) while a member may be stopped.
_SHELL = r"""
import os, pathlib, subprocess, sys, time
root = pathlib.Path(sys.argv[1])
subprocess.Popen([sys.executable, "-c", sys.argv[2], str(root)], process_group=0)
while not (root / "frozen").exists():
    time.sleep(0.05)
os._exit(0)
"""


def test_a_frozen_node_stays_frozen_when_the_harness_group_is_orphaned_and_nobody_gets_sighup(tmp_path):
    """Before, the nodes shared the harness' process group, and the kernel sends SIGHUP +
    SIGCONT to every member of a group that becomes orphaned with a member stopped: in a
    chaos run launched with ``nohup ... &`` whose launching shell ended during a node-stop,
    every daemon reloaded its config, every agent died of SIGHUP and the frozen node went
    on. Now each node has a group of its own, whose parent (the harness) links it."""
    subprocess.run([sys.executable, "-c", _SHELL, str(tmp_path), _HARNESS], timeout=60,
                   start_new_session=True, check=True)
    assert proctree.wait_for(lambda: (tmp_path / "result").exists(), 30, 0.1)
    proctree.wait_for(lambda: not proctree.descendants(), 10, 0.1)   # the harness exits
    proctree.reap_children()
    assert (tmp_path / "result").read_text() == "stopped"
    assert not (tmp_path / "a.hup").exists() and not (tmp_path / "b.hup").exists()
