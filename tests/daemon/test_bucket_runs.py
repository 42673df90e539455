"""Issue 28: a job whose checkpoints live in object storage, end to end. Three real daemons,
real torchrun, gloo, float64, ``[checkpoint] dir = s3://...`` on a real S3-compatible server
(SeaweedFS on 127.0.0.1), credentials and endpoint from the environment as a cloud node
has them. The restart path, so every recovery resumes from the bucket: a node SIGKILLed,
then a node drained; each restart resumes at the last step done before it (exactly once),
and the final checkpoint, read from the bucket, matches the replay oracle.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.daemon.runs import (
    by_rank,
    completed,
    entry,
    matches_the_replay,
    resumed_where_it_stopped,
    world_of_three,
)
from tests.daemon_nodes import DaemonNode, stepping_at, stop_nodes, wait_for

# 50 s: in `make slow` (CI's `make test` keeps the bucket's contract and manager tests).
pytestmark = pytest.mark.slow


def test_a_crash_and_a_drain_resume_from_the_bucket(tmp_path, job_id, etcd_server, bucket):
    final = 150
    nodes: list[DaemonNode] = []

    def start(name: str) -> DaemonNode:
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path, {
            "entrypoint": entry(final), "every_steps": 10, "min_nodes": 1,
            "recovery": "restart"}, ckpt_dir=bucket).start()
        nodes.append(node)
        return node

    try:
        three = world_of_three(start)
        holder = by_rank(three, True)
        victim = next(n for n in three if n is not holder)
        crash = time.time()
        victim.kill()
        survivors = [n for n in three if n is not victim]
        wait_for(lambda: stepping_at(survivors, 2, crash), 90, "a world of 2 after the crash", nodes)
        for node in survivors:
            resumed_where_it_stopped(node, crash)
        leaver = next(n for n in survivors if n is not holder)
        drained = time.time()
        leaver.proc.send_signal(signal.SIGTERM)
        assert leaver.proc.wait(timeout=60) == 0, leaver.log_tail()
        wait_for(lambda: stepping_at([holder], 1, drained), 90, "the last node stepping alone", nodes)
        resumed_where_it_stopped(holder, drained)
        completed([holder])
        history = matches_the_replay(holder, bucket, final)
        assert {w for w, _ in history.values()} == {3, 2, 1}
        assert not (tmp_path / "ckpt").exists()   # nothing went to a local directory
    finally:
        stop_nodes(nodes)
