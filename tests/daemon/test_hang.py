"""Training-hang detection: a rank that hangs (alive, no crash, no peer died) stops the
step on every node; each daemon sees its workers alive but the step stuck past the
bound, kills them, and the job recovers as from a crash and completes.

Real etcd, two real daemons, real torchrun, gloo.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.journal import recent_events
from elasticd.rendezvous.keys import JobKeys
from tests.daemon_nodes import DaemonNode, stepping_at, stop_nodes, wait_for

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "hang_once.py")


def test_a_hung_rank_is_detected_and_the_job_completes(etcd_server, tmp_path, job_id):
    marker = tmp_path / "hung"
    entry = [WORKER, "--max-steps", "160", "--step-sleep", "0.05", "--log-every", "100"]
    kw = {"entrypoint": entry, "min_nodes": 2, "max_nodes": 2, "extra": "hang_timeout_s = 5"}
    env = {"HANG_MARKER": str(marker), "HANG_RANK": "1", "HANG_AFTER": "40"}
    nodes = [DaemonNode(n, etcd_server.endpoint, job_id, tmp_path, kw, env=env).start() for n in "ab"]
    try:
        wait_for(lambda: stepping_at(nodes, 2, 0), 120, "world of 2", nodes)
        wait_for(marker.exists, 60, "rank 1 to hang", nodes)
        hung_at = time.time()
        wait_for(lambda: all(any(e["event"].startswith("training hung") for e in n.daemon_events())
                             for n in nodes), 60, "both daemons to detect the hang", nodes)
        wait_for(lambda: stepping_at(nodes, 2, hung_at + 5), 90, "world of 2 after the hang", nodes)
        wait_for(lambda: all(not n.running() for n in nodes), 120, "the job to complete", nodes)
        assert [n.proc.returncode for n in nodes] == [0, 0], [n.log_tail() for n in nodes]
        client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
        try:
            kinds = [e.get("kind") for e in recent_events(client, JobKeys(job_id), 100)]
        finally:
            client.close()
        assert kinds.count("training-hang") == 2, kinds
        assert "job-completed" in kinds
    finally:
        stop_nodes(nodes)
