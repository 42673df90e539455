"""A hand-written DDP loop under three real daemons: converted (ddp_elastic.py, and
ddp_inplace.py on ``ElasticState.run``) and plain.

The converted loop survives a node SIGKILL, a rank-0 node SIGKILL and a drain, each run to
completion and checked: the final checkpoint equals a single-process float64 replay of the
logged world sizes, stream positions and LRs (1e-9); the positions tile the stream (every
sample once per epoch); every step's LR is the warm-up + cosine formula times the world
factor (1e-12), continued at the right step after each resume. The plain script
(ddp_plain.py), which knows nothing of elasticd, runs to completion through a node SIGKILL:
the daemons restart it and it resumes from its own end-of-epoch snapshot. The loop on
``ElasticState.run`` (ddp_inplace.py) survives the same crashes in place: no restart, 0
steps lost, the same checks.

The daemons run their default recovery mode (in place): a loop that cannot re-form in place
publishes no generation, so its faults take the restart path.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.daemon.runs import (
    by_rank,
    completed,
    final_matches_replay,
    lose_one,
    progress_records,
    world_of_three,
)
from tests.daemon_nodes import DaemonNode, agent_events, stepping_at, stop_nodes, wait_for
from tests.oracle import consumed_exactly_once, lineage, replay_dropin
from trainer.examples import regression

pytestmark = pytest.mark.dropin

REPO = Path(__file__).resolve().parents[2]
CONVERTED = str(REPO / "trainer" / "examples" / "ddp_elastic.py")
PLAIN = str(REPO / "trainer" / "examples" / "ddp_plain.py")
IN_PLACE = str(REPO / "trainer" / "examples" / "ddp_inplace.py")
JOB = ["--samples=240", "--batch-size=4", "--dtype=float64", "--lr=0.005", "--seed=9",
       "--warmup-steps=10", "--cosine-steps=200", "--epochs=5"]
ARGS = regression.arguments("test", JOB)
BASE_WORLD = 3  # the LR is for the first world


@pytest.fixture
def job(tmp_path, job_id, etcd_server):
    nodes: list[DaemonNode] = []

    def add(name: str, script: str = CONVERTED, *extra: str) -> DaemonNode:
        entry = [script, *JOB, "--step-sleep=0.03", "--log-every=1", "--lr-rule=linear",
                 f"--lr-base-world-size={BASE_WORLD}", *extra]
        # min_nodes 2: these faults take the restart path, whose new round has 2 nodes
        # (world_of_three waits until the third has joined).
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path, {
            "entrypoint": entry, "every_steps": 10, "min_nodes": 2}).start()
        nodes.append(node)
        return node

    yield add, nodes
    stop_nodes(nodes)


def _checked(node: DaemonNode, ckpt: Path) -> dict[int, dict]:
    """The oracle, exactly-once and LR checks on the rank-0 lineage; returns it."""
    history = lineage(progress_records(node))
    final_matches_replay(ckpt, history, lambda: replay_dropin(ARGS, history))
    consumed_exactly_once(history, ARGS.samples, ARGS.epochs)
    for step, rec in history.items():
        unscaled = ARGS.lr * regression.warmup_cosine_factor(
            step - 1, ARGS.warmup_steps, ARGS.cosine_steps, ARGS.warmup_start)
        assert rec["lr"] == pytest.approx(unscaled * rec["world_size"] / BASE_WORLD,
                                          rel=1e-12, abs=1e-15), step
    return history


@pytest.mark.parametrize("victim_rank0", [pytest.param(False, id="node", marks=pytest.mark.compat),
                                          pytest.param(True, id="rank0-node")])
def test_the_converted_loop_survives_a_node_crash(job, tmp_path, victim_rank0):
    add, nodes = job
    # Past a checkpoint of the world of 3 (every 10 steps): a rank-0 node's crash loses
    # the steps since (nobody else can commit them), and the history must still hold 3.
    three = world_of_three(add, at_step=25)
    _, survivors, since = lose_one(three, nodes, rank0=victim_rank0, within_s=60)
    completed(survivors)
    rank0 = by_rank(survivors, True)
    resumed = [r for r in progress_records(rank0) if r["event"] == "resumed" and r["time"] > since]
    assert resumed, "the survivors never resumed"
    history = _checked(rank0, tmp_path / "ckpt")
    assert {rec["world_size"] for rec in history.values()} == {3, 2}


@pytest.mark.parametrize("victim_rank0", [False, True], ids=["node", "rank0-node"])
def test_the_loop_on_state_run_re_forms_in_place_with_zero_steps_lost(job, tmp_path,
                                                                       victim_rank0):
    add, nodes = job
    three = world_of_three(lambda name: add(name, IN_PLACE), at_step=25)
    _, survivors, since = lose_one(three, nodes, rank0=victim_rank0, within_s=30)
    completed(survivors)
    for node in survivors:
        later = [r for r in progress_records(node) if r["time"] > since]
        reformed = [r for r in later if r["event"] == "reformed"]
        assert [r["world_size"] for r in reformed] == [2], node.name
        print(f"{node.name}: re-formed in place in {reformed[0]['duration_s']:.3f} s")
        assert not [r for r in later if r["event"] in ("resumed", "reform-failed")], node.name
    history = _checked(by_rank(survivors, True), tmp_path / "ckpt")
    assert {rec["world_size"] for rec in history.values()} == {3, 2}


def test_the_converted_loop_drains_with_zero_steps_lost(job, tmp_path):
    add, nodes = job
    three = world_of_three(add)
    leaver = by_rank(three, rank0=False)
    survivors = [n for n in three if n is not leaver]
    since = time.time()
    leaver.proc.send_signal(15)  # SIGTERM to the daemon: drain
    assert leaver.proc.wait(timeout=90) == 0, leaver.log_tail()
    stopped = [e for e in agent_events(leaver, "stopped") if e["time"] > since]
    assert stopped, "the drained node's workers never took the coordinated stop"
    wait_for(lambda: stepping_at(survivors, 2, since), 60, "world 2 after the drain", nodes)
    completed(survivors)
    rank0 = by_rank(survivors, True)
    resumed = [r for r in progress_records(rank0) if r["event"] == "resumed" and r["time"] > since]
    assert resumed[0]["step"] == stopped[-1]["step"], "the drain lost steps"
    _checked(rank0, tmp_path / "ckpt")


def test_the_plain_script_runs_unchanged_and_resumes_from_its_own_snapshot(job, tmp_path):
    add, nodes = job
    snapshot = f"--snapshot={tmp_path / 'snapshot.pt'}"
    three = [add(name, PLAIN, snapshot) for name in "abc"]

    def output(node: DaemonNode) -> str:
        path = node.run_dir / "agent.log"
        return path.read_text(errors="replace") if path.exists() else ""

    wait_for(lambda: all("epoch 0 done" in output(n) for n in three), 180, "an epoch done", nodes)
    three[1].kill()
    survivors = [three[0], three[2]]
    completed(survivors, timeout_s=240)
    for node in survivors:
        text = output(node)
        assert "resumed from" in text and f"epoch {ARGS.epochs - 1} done" in text, text[-3000:]
