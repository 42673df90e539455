"""Real torchrun processes: a world-size history 2 -> 1 -> 2 equals a single-process replay.

The scenario (one module-scoped run, several tests read it):

A. 2 workers from scratch; SIGTERM to rank 1 -> coordinated stop at an agreed step.
B. 1 worker resumes there (LR ramps down); the whole tree is SIGKILLed: the steps
   since the last periodic checkpoint are lost and done again by C.
C. 2 workers resume from B's newest checkpoint (LR ramps up) and complete.

The per-step world sizes and LRs are read back from rank 0's progress lines; the
replay applies them with plain torch on one process, in float64.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointManager
from elasticd.lab.embedded_etcd import free_port
from tests.oracle import Run, max_rel_diff, replay, step_history
from tests.trainer.launch import Launch
from trainer.examples import mlp
from trainer.exitcodes import STOP_EXIT_CODE

SAMPLES, BATCH, LR, SEED, DATA_SEED, MOMENTUM, WARMUP = 203, 8, 0.05, 3, 1234, 0.9, 3


RUN = Run(SAMPLES, BATCH, LR, SEED, DATA_SEED, MOMENTUM)


def _args(ckpt: Path, *extra: str) -> list[str]:
    return [*RUN.args(), "--lr-rule=linear", f"--lr-warmup-steps={WARMUP}", f"--checkpoint-dir={ckpt}",
            "--checkpoint-every-steps=5", *extra]


# Every test reads the one scenario the module fixture runs (30-40 s).
pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic")
    ckpt = work / "ckpt"
    slow = ["--max-steps=100000", "--step-sleep=0.03"]
    launches: list[Launch] = []
    try:
        a = _started(launches, Launch(work, "a", 2, _args(ckpt, *slow)))
        a.wait_step(9)
        a.signal_worker(1, signal.SIGTERM)
        assert a.wait(60) != 0  # torchrun reports the workers' exit 75 as a failure
        stop_step = a.events()[-1]["step"]
        b = _started(launches, Launch(work, "b", 1, _args(ckpt, *slow)))
        b.wait_step(stop_step + 12)
        b.kill()
        final = stop_step + 30
        c = _started(launches, Launch(work, "c", 2, _args(ckpt, f"--max-steps={final}")))
        assert c.wait(90) == 0, c.tail()
    finally:
        for launch in launches:
            launch.kill()
    return {"a": a, "b": b, "c": c, "ckpt": ckpt, "final": final, "stop_step": stop_step}


def _started(launches: list[Launch], launch: Launch) -> Launch:
    launches.append(launch)
    return launch.start()


def test_world_size_history_equals_single_process_replay(scenario):
    history = step_history(e for launch in (scenario["a"], scenario["b"], scenario["c"])
                           for e in launch.events())
    assert sorted(history) == list(range(1, scenario["final"] + 1))
    assert {w for w, _ in history.values()} == {1, 2}
    final = CheckpointManager(scenario["ckpt"], read_only=True).load_latest()
    assert final.step == scenario["final"]
    rel = max_rel_diff(final.state["model"], replay(RUN, history))
    print(f"oracle max relative difference: {rel:.3e}")
    assert rel < 1e-9


def test_sigterm_to_one_worker_commits_the_agreed_step_and_loses_nothing(scenario):
    a_events, b_events = scenario["a"].events(), scenario["b"].events()
    stop = scenario["stop_step"]
    assert a_events[-1]["event"] == "stopped"
    assert max(e["step"] for e in a_events) == stop  # nothing ran past the agreed step
    exits = scenario["a"].exits()
    assert sorted(exits) == [0, 1]
    assert {e["exit_code"] for e in exits.values()} == {STOP_EXIT_CODE}
    assert {e["step"] for e in exits.values()} == {stop}
    resumed = b_events[0]
    assert (resumed["event"], resumed["step"], resumed["from_world_size"]) == ("resumed", stop, 2)


def test_lr_is_rescaled_after_resume_and_ramps(scenario):
    base = LR  # the first world (2) is the base world
    b_events, c_events = scenario["b"].events(), scenario["c"].events()
    b_steps = [e["lr"] for e in b_events if e["event"] in ("step", "checkpoint")]
    # B: world 2 -> 1, linear rule, ramp of 3 steps from factor 1 to 0.5.
    assert b_events[0]["lr"] == pytest.approx(base * (1 - 0.5 / 3), rel=1e-12)
    assert b_steps[:5] == pytest.approx([base * f for f in (1 - 0.5 / 3, 1 - 1 / 3, 0.5, 0.5,
                                                             0.5)], rel=1e-12)
    # C: world 1 -> 2, from 0.5 back to 1.
    c_steps = [e["lr"] for e in c_events if e["event"] in ("step", "checkpoint")]
    assert c_steps[:4] == pytest.approx([base * f for f in (0.5 + 0.5 / 3, 0.5 + 1 / 3, 1, 1)],
                                        rel=1e-12)
    # The LR actually used is saved with the checkpoint.
    final = CheckpointManager(scenario["ckpt"], read_only=True).load_latest()
    assert final.state["lr"]["lrs_used"] == [pytest.approx(base)]


def test_optimizer_lr_after_resume_in_a_new_world(scenario, tmp_path, monkeypatch):
    """In process: resume the 2-worker checkpoint with 1 worker; read the optimizer's LR."""
    from trainer import dist as tdist
    from trainer.context import ElasticContext
    from trainer.loop import ElasticTrainer, TrainConfig

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = ElasticContext.single_process(master_port=port, checkpoint_dir=str(scenario["ckpt"]),
                                        lr_rule="linear", lr_warmup_steps=WARMUP)
    x, y = mlp.make_data(SAMPLES, DATA_SEED, torch.float64)
    model = mlp.make_model(torch.float64)
    opt = mlp.make_optimizer(model, LR, MOMENTUM)
    trainer = ElasticTrainer(model, opt, SAMPLES, lambda i: (x[i], y[i]), mlp.per_sample_loss,
                             TrainConfig(micro_batch=BATCH, max_steps=10**6, seed=SEED), ctx=ctx)
    try:
        trainer._setup()
        assert trainer.state.step == scenario["final"]
        # The optimizer holds the unscaled LR between steps (trainer.worldlr); the next
        # update uses the rescaled one, whatever LR the loaded optimizer state carried.
        assert opt.param_groups[0]["lr"] == LR
        assert trainer.es.lr.preview()[0] == pytest.approx(LR * (1 - 0.5 / WARMUP), rel=1e-12)
        assert opt.param_groups[0]["momentum"] == MOMENTUM
    finally:
        tdist.shutdown()
