"""The char-level transformer example trains and resumes under torchrun on CPU."""

from __future__ import annotations

import math

import pytest

from tests.trainer.launch import Launch

SMALL = ["--corpus-chars=4000", "--context=16", "--dim=32", "--layers=1", "--heads=2",
         "--batch-size=8", "--log-every=1"]


@pytest.mark.slow
def test_charlm_trains_and_resumes_at_another_world_size(tmp_path):
    ckpt = f"--checkpoint-dir={tmp_path / 'ckpt'}"
    first = Launch(tmp_path, "lm1", 2, [*SMALL, ckpt, "--max-steps=4"], script="charlm.py")
    assert first.run() == 0, first.tail()
    second = Launch(tmp_path, "lm2", 1, [*SMALL, ckpt, "--max-steps=6", "--lr-rule=sqrt"],
                    script="charlm.py")
    assert second.run() == 0, second.tail()
    events = second.events()
    assert events[0]["event"] == "resumed" and events[0]["step"] == 4
    assert events[-1]["event"] == "completed" and events[-1]["step"] == 6
    # The loss is agreed one step after its post (trainer.dist.Agreement): none yet at the
    # first step; the first two posts are a step apart whatever the step time.
    steps = [e for e in events if e["event"] == "step"]
    assert steps[0]["loss"] is None and steps[0]["loss_step"] is None
    assert all(math.isfinite(e["loss"]) and e["loss_step"] == e["step"] - 1 for e in steps[1:])
    assert events[-1]["lr"] == pytest.approx(3e-3 / math.sqrt(2), rel=1e-12)  # sqrt rule, base 2


def test_heavy_state_is_its_size_and_frozen():
    from trainer.examples import heavy

    args = heavy.arguments(["--state-mb=4", "--startup-delay-s=0.5"])
    model, optimizer = heavy.build(args)
    assert args.startup_delay_s == 0.5 and not model.frozen.requires_grad
    assert 4 * 2**20 <= heavy.state_bytes(model) < 4 * 2**20 + 10_000   # the MLP is ~2.5 kB
    trained = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert id(model.frozen) not in trained and trained == {id(p) for p in model.mlp.parameters()}
