"""The local-cluster harness itself: whatever happens in the block, every process the
cluster started is gone when it ends (orphans and stopped processes included), and
nothing it did not start is touched."""

from __future__ import annotations

import signal
import subprocess

import psutil
import pytest

from elasticd import proctree
from elasticd.local_cluster import AllreduceNode, latest, local_cluster, wait_for


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
