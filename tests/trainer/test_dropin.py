"""The converted hand-written loop (trainer/examples/ddp_elastic.py) under real torchrun.

The scenario (one module-scoped run, several tests read it):

A. 2 workers from scratch; SIGTERM to rank 1 -> coordinated stop at an agreed step.
B. 1 worker with a DataLoader worker process resumes there; the whole tree is
   SIGKILLed: the steps since the last periodic checkpoint are done again by C.
C. 3 workers resume from B's newest checkpoint and complete the epochs.

Checked: the final checkpoint equals a single-process float64 replay of the logged
world sizes, stream positions and LRs (Adam, DDP's mean of per-rank means); the
positions tile the stream (every sample once per epoch); the warm-up + cosine LR of
every step is the formula times the world factor, continued across each resume.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from checkpointing import CheckpointManager
from tests.oracle import consumed_exactly_once, lineage, max_rel_diff, replay_dropin
from tests.trainer.launch import Launch
from trainer.examples import regression
from trainer.exitcodes import STOP_EXIT_CODE

JOB = ["--samples=120", "--batch-size=4", "--dtype=float64", "--lr=0.01", "--seed=5",
       "--warmup-steps=6", "--cosine-steps=80", "--epochs=3"]
ARGS = regression.arguments("test", JOB)
BASE_WORLD = 2


def _args(ckpt: Path, *extra: str) -> list[str]:
    return [*JOB, f"--checkpoint-dir={ckpt}", "--checkpoint-every-steps=4", "--lr-rule=linear",
            f"--lr-base-world-size={BASE_WORLD}", *extra]


# Every test reads the one scenario the module fixture runs (30-40 s).
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("dropin")
    ckpt = work / "ckpt"
    slow = "--step-sleep=0.03"
    launches: list[Launch] = []

    def started(launch: Launch) -> Launch:
        launches.append(launch)
        return launch.start()

    try:
        a = started(Launch(work, "a", 2, _args(ckpt, slow), script="ddp_elastic.py"))
        a.wait_step(7)
        a.signal_worker(1, signal.SIGTERM)
        assert a.wait(60) != 0  # torchrun reports the workers' exit 75 as a failure
        b = started(Launch(work, "b", 1, _args(ckpt, slow, "--workers=1"),
                           script="ddp_elastic.py"))
        b.wait_step(a.events()[-1]["step"] + 10)
        b.kill()
        c = started(Launch(work, "c", 3, _args(ckpt), script="ddp_elastic.py"))
        assert c.wait(120) == 0, c.tail()
    finally:
        for launch in launches:
            launch.kill()
    return {"a": a, "b": b, "c": c, "ckpt": ckpt}


def _history(scenario) -> dict[int, dict]:
    return lineage(e for name in "abc" for e in scenario[name].events())


def test_the_run_equals_a_single_process_replay(scenario):
    history = _history(scenario)
    assert sorted(history) == list(range(1, max(history) + 1))
    assert {rec["world_size"] for rec in history.values()} == {2, 1, 3}
    final = CheckpointManager(scenario["ckpt"], read_only=True).load_latest()
    assert final.step == max(history)
    rel = max_rel_diff(final.state["model"], replay_dropin(ARGS, history))
    print(f"oracle: max relative difference {rel:.3e} over {final.step} steps")
    assert rel < 1e-9


def test_every_sample_once_per_epoch(scenario):
    consumed_exactly_once(_history(scenario), ARGS.samples, ARGS.epochs)


def test_the_schedule_continues_at_the_right_step_after_each_resume(scenario):
    history = _history(scenario)
    for step, rec in history.items():
        # The record of step s is the update from s - 1: the scheduler's LR there, times
        # the world factor (linear rule, base world 2).
        unscaled = ARGS.lr * regression.warmup_cosine_factor(
            step - 1, ARGS.warmup_steps, ARGS.cosine_steps, ARGS.warmup_start)
        assert rec["lr"] == pytest.approx(unscaled * rec["world_size"] / BASE_WORLD,
                                          rel=1e-12, abs=1e-15), step
    resumes = [e for name in "bc" for e in scenario[name].events() if e["event"] == "resumed"]
    assert len(resumes) == 2
    # A resume reports the LR of its next update: the schedule at that step, new world.
    for rec in resumes:
        unscaled = ARGS.lr * regression.warmup_cosine_factor(
            rec["step"], ARGS.warmup_steps, ARGS.cosine_steps, ARGS.warmup_start)
        assert rec["lr"] == pytest.approx(unscaled * rec["world_size"] / BASE_WORLD, rel=1e-12)


def test_the_stop_was_agreed_and_committed(scenario):
    a = scenario["a"]
    exits = a.exits()
    assert {e["exit_code"] for e in exits.values()} == {STOP_EXIT_CODE}
    stop = a.events()[-1]
    assert stop["event"] == "stopped" and {e["step"] for e in exits.values()} == {stop["step"]}
    b_resumed = scenario["b"].events()[0]
    assert (b_resumed["event"], b_resumed["step"], b_resumed["from_world_size"]) == (
        "resumed", stop["step"], 2)
    assert b_resumed["position"] == stop["position"]
