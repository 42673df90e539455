"""Constant-global-batch mode: a 1 -> 2 worker run equals a fault-free 2-worker run.

33 samples with a global batch of 16 make every epoch end with a 1-sample step, so
one rank's share (and with accumulation, some micro-batches) is empty: the loop's
zero-weight filler forward must keep DDP in step without changing the result.
"""

from __future__ import annotations

import pytest
import torch

from checkpointing import CheckpointManager
from tests.trainer.launch import Launch


def _args(ckpt, max_steps: int) -> list[str]:
    return ["--dtype=float64", "--samples=33", "--batch-size=4", "--global-batch=16",
            "--lr=0.05", "--lr-rule=linear", "--seed=5", f"--checkpoint-dir={ckpt}",
            f"--max-steps={max_steps}"]


def _final_model(ckpt) -> dict[str, torch.Tensor]:
    found = CheckpointManager(ckpt, read_only=True).load_latest()
    assert found is not None
    return found.state["model"], found.step


@pytest.mark.slow
def test_constant_global_batch_is_world_size_invariant(tmp_path):
    straight = tmp_path / "straight"
    assert Launch(tmp_path, "straight", 2, _args(straight, 9)).run() == 0
    elastic = tmp_path / "elastic"
    # (2 -> 1 -> 2 is the replay oracle's history; a third launch here buys little.)
    for name, world, until in (("e1", 1, 4), ("e2", 2, 9)):
        launch = Launch(tmp_path, name, world, _args(elastic, until))
        assert launch.run() == 0, launch.tail()
        assert {e["global_batch"] for e in launch.events()} == {16}
        lrs = {e["lr"] for e in launch.events() if e["event"] == "step"}
        assert lrs == {0.05}  # the LR rule is ignored: the global batch never changes
    want, want_step = _final_model(straight)
    got, got_step = _final_model(elastic)
    assert got_step == want_step == 9
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-9, atol=1e-12)
