"""A node that cannot resume the job leaves it; the others go on (issue 29 finding 5).

Before: a 4th node whose checkpoint directory lacked the job's checkpoints (a failed
mount) joined a 3-node job; its workers raised "no checkpoint of step 217", every other
node's workers failed on the collective that followed, every daemon counted it as its
own crash, and 17 s later all four daemons were FAILED. Now the workers agree on the
job's newest checkpoint before loading (``trainer.fitness``): the joiner's daemon leaves
the job (exit 3, journal ``node-unfit`` naming its directory and the fix), the three
others restart without it, count no crash, and finish the job exactly (replay oracle).

Real etcd, four real daemons, real torchrun, gloo, float64.
"""

from __future__ import annotations

import pytest

from elasticd.journal import recent_events
from elasticd.rendezvous.keys import JobKeys
from tests.conftest import connect
from tests.daemon.runs import (
    by_rank,
    completed,
    entry,
    matches_the_replay,
    no_crash_counted,
    world_of_three,
)
from tests.daemon_nodes import DaemonNode, log_lines, stop_nodes, wait_for
from trainer.exitcodes import UNFIT_EXIT_CODE

FAILED_EXIT_CODE = 3  # elasticd.daemon.FAILED_EXIT_CODE (the unit does not restart it)


@pytest.fixture
def nodes():
    started: list[DaemonNode] = []
    yield started
    stop_nodes(started)


def test_a_joiner_without_the_checkpoints_leaves_and_the_others_finish(
        nodes, etcd_server, tmp_path, job_id):
    final = 450
    kw = {"entrypoint": entry(final), "every_steps": 10, "min_nodes": 3, "max_nodes": 4}

    def add(name: str, **extra) -> DaemonNode:
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path, kw, **extra).start()
        nodes.append(node)
        return node

    three = world_of_three(add)
    mount = tmp_path / "failed-mount"
    mount.mkdir()
    joiner = add("d", ckpt_dir=mount)
    wait_for(lambda: not joiner.running(), 120, "the joiner's daemon to leave the job", nodes)
    assert joiner.proc.returncode == FAILED_EXIT_CODE, joiner.log_tail()
    exits = {e["exit_code"] for e in joiner.worker_events("worker exit")}
    assert exits == {UNFIT_EXIT_CODE}, joiner.log_tail()
    (sentence,) = [e["event"] for e in log_lines(joiner) if "cannot resume" in e["event"]]
    assert str(mount) in sentence and "Fix: mount the job's shared checkpoint" in sentence
    completed(three, timeout_s=240)
    for node in three:
        no_crash_counted(node)
        assert any("after a membership" in e["event"] for e in log_lines(node))
        assert {e["exit_code"] for e in node.worker_events("worker exit")} <= {0, 1, 75}
    client = connect(etcd_server)
    try:
        events = recent_events(client, JobKeys(job_id), 200)
    finally:
        client.close()
    unfit = [e for e in events if e.get("kind") == "node-unfit"]
    assert [e.get("node") for e in unfit] == ["d"], events
    assert [e.get("node") for e in events if e.get("kind") == "node-failed"] == ["d"]
    history = matches_the_replay(by_rank(three, True), tmp_path / "ckpt", final)
    assert {w for w, _ in history.values()} == {3}  # the joiner never trained
