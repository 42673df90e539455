"""A diverging job ends instead of looping: the loss goes non-finite, every worker
stops as diverged (exit 65, nothing committed), and each daemon marks its node failed
at once (exit 3, journal ``training-diverged``) instead of restarting the workers from
the last checkpoint, where they would diverge again (the goodput run's 18 restarts).

Real etcd, two real daemons, real torchrun, gloo.
"""

from __future__ import annotations

import pytest

from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.journal import recent_events
from elasticd.rendezvous.keys import JobKeys
from tests.daemon_nodes import MLP, DaemonNode, stop_nodes, wait_for
from trainer.exitcodes import DIVERGED_EXIT_CODE

FAILED_EXIT_CODE = 3  # elasticd.daemon.FAILED_EXIT_CODE (the unit does not restart it)


@pytest.mark.slow
def test_a_diverging_job_marks_every_node_failed_without_restarts(etcd_server, tmp_path, job_id):
    entry = [MLP, "--max-steps", "100000", "--step-sleep", "0.02", "--lr", "1e6",
             "--log-every", "1000"]
    kw = {"entrypoint": entry, "min_nodes": 2, "max_nodes": 2}
    nodes = [DaemonNode(n, etcd_server.endpoint, job_id, tmp_path, kw).start() for n in "ab"]
    try:
        wait_for(lambda: all(not n.running() for n in nodes), 180, "both daemons to exit", nodes)
        assert [n.proc.returncode for n in nodes] == [FAILED_EXIT_CODE] * 2, \
            [n.log_tail() for n in nodes]
        for node in nodes:
            exits = node.worker_events("worker exit")
            assert exits and {e["exit_code"] for e in exits} == {DIVERGED_EXIT_CODE}, exits
            sentences = [e["event"] for e in node.daemon_events()]
            assert any(s.startswith("training diverged at step") for s in sentences), sentences
            assert not any("restarted its workers" in s for s in sentences), sentences
        client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
        try:
            kinds = [e.get("kind") for e in recent_events(client, JobKeys(job_id), 100)]
        finally:
            client.close()
        assert kinds.count("training-diverged") == 2 and kinds.count("node-failed") == 2, kinds
    finally:
        stop_nodes(nodes)
