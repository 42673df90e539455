"""A node that cannot resume the job leaves it; the others go on (issue 29 findings 5, 9).

Before: a 4th node whose checkpoint directory lacked the job's checkpoints (a failed
mount) joined a 3-node job; its workers raised "no checkpoint of step 217", every other
node's workers failed on the collective that followed, every daemon counted it as its
own crash, and 17 s later all four daemons were FAILED. Now the workers agree on the
job's newest checkpoint before loading (``trainer.fitness``): the joiner's daemon leaves
the job (exit 3, journal ``node-unfit`` naming its directory and the fix), the three
others restart without it, count no crash, and finish the job exactly (replay oracle).

Before (finding 9): one node's NaN loss (a bit flip, a broken device) reached every
rank's weights through the gradients, the agreed loss stayed NaN, and every node stopped
as diverged: every daemon FAILED. Now the ranks compare the first step their own loss was
not finite (``trainer.nonfinite``): that node leaves (``node-unfit``), the others resume
the last checkpoint, which holds no NaN (no save of non-finite weights), and finish.

Real etcd, real daemons, real torchrun, gloo, float64.
"""

from __future__ import annotations

from pathlib import Path

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

NAN_MLP = str(Path(__file__).resolve().parents[1] / "workers" / "nan_mlp.py")
FAILED_EXIT_CODE = 3  # elasticd.daemon.FAILED_EXIT_CODE (the unit does not restart it)


@pytest.fixture
def nodes():
    started: list[DaemonNode] = []
    yield started
    stop_nodes(started)


def _journal(etcd_server, job_id) -> list[dict]:
    client = connect(etcd_server)
    try:
        return recent_events(client, JobKeys(job_id), 200)
    finally:
        client.close()


@pytest.mark.slow
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
    events = _journal(etcd_server, job_id)
    unfit = [e for e in events if e.get("kind") == "node-unfit"]
    assert [e.get("node") for e in unfit] == ["d"], events
    assert [e.get("node") for e in events if e.get("kind") == "node-failed"] == ["d"]
    history = matches_the_replay(by_rank(three, True), tmp_path / "ckpt", final)
    assert {w for w, _ in history.values()} == {3}  # the joiner never trained


@pytest.mark.slow
def test_a_node_whose_loss_goes_nan_first_leaves_and_the_others_finish_exactly(
        nodes, etcd_server, tmp_path, job_id):
    final = 450
    arm = tmp_path / "arm"
    kw = {"entrypoint": entry(final, NAN_MLP), "every_steps": 10, "min_nodes": 2, "max_nodes": 3}

    def add(name: str) -> DaemonNode:
        env = {"NAN_ARM": str(arm)} if name == "c" else {}
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path, kw, env=env).start()
        nodes.append(node)
        return node

    a, b, c = world_of_three(add)
    arm.touch()  # c's next loss is NaN
    wait_for(lambda: not c.running(), 120, "the faulty node's daemon to leave the job", nodes)
    assert c.proc.returncode == FAILED_EXIT_CODE, c.log_tail()
    assert {e["exit_code"] for e in c.worker_events("worker exit")} == {UNFIT_EXIT_CODE}
    (sentence,) = [e["event"] for e in log_lines(c) if "computed a non-finite loss" in e["event"]]
    assert "while every other node's was finite" in sentence and "Fix: check this node's" in sentence
    completed([a, b], timeout_s=240)
    for node in (a, b):
        no_crash_counted(node)
        assert {e["exit_code"] for e in node.worker_events("worker exit")} <= {0, 1, 75}
    events = _journal(etcd_server, job_id)
    assert [e.get("node") for e in events if e.get("kind") == "node-unfit"] == ["c"], events
    assert [e.get("node") for e in events if e.get("kind") == "node-failed"] == ["c"]
    assert not [e for e in events if e.get("kind") == "training-diverged"], events
    # The NaN steps were never committed: the survivors' history from the last good
    # checkpoint on replays exactly to the final model.
    history = matches_the_replay(by_rank([a, b], True), tmp_path / "ckpt", final)
    assert {w for w, _ in history.values()} == {3, 2}
