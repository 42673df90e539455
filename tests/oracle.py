"""The replay oracles of the tests: the MLP example's (``elasticd.lab.chaos.oracle``, re-exported
here) and the drop-in loop's (``replay_dropin``, with its exactly-once check).

Every step of the MLP example is one SGD update on the step's whole global batch (the
loop averages over it exactly, whatever the split), so a fault-free single-process
replay of the same (world size, LR) history must reach the same parameters. The data
order is the sampler's: per-epoch permutations and a global cursor, so a replay that
matches also used every sample exactly once per epoch.
"""

from __future__ import annotations

from argparse import Namespace

import numpy as np
import torch

# The MLP replay lives with the chaos harness (which must not import tests/); one definition.
from elasticd.lab.chaos.oracle import Run, lineage, max_rel_diff, norm_rel_diff, replay, step_history
from trainer.distributed_sampler import stream_indices
from trainer.examples import regression

__all__ = ["Run", "consumed_exactly_once", "lineage", "max_rel_diff", "norm_rel_diff", "rank_shares",
           "replay", "replay_dropin", "step_history"]


def rank_shares(seed: int, length: int, start: int, end: int, world: int) -> list[np.ndarray]:
    """The dataset indices each rank of ``world`` used for the stream range [start, end).

    ElasticDistributedSampler's strided layout: rank r took positions start + r + world*j.
    """
    if (end - start) % world:
        raise AssertionError(f"step consumed {end - start} positions, not a multiple of {world}")
    idx = stream_indices(seed, length, True, start, end - start)
    return [idx[r::world] for r in range(world)]


def replay_dropin(args: Namespace, history: dict[int, dict]) -> dict[str, torch.Tensor]:
    """ddp_elastic.py replayed on one process: each step, the mean over ranks of each rank's
    mean loss (DDP's average of per-rank gradients) on exactly the samples that rank used
    (from the logged stream positions), Adam at the logged LR."""
    dataset = regression.make_dataset(args)
    x, y = dataset.tensors
    model = regression.make_model(args)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    previous = 0
    for step in range(1, max(history) + 1):
        rec = history[step]
        shares = rank_shares(args.seed, len(x), previous, rec["position"], rec["world_size"])
        opt.zero_grad()
        losses = [torch.nn.functional.mse_loss(model(x[i]), y[i]) for i in shares]
        (sum(losses) / len(shares)).backward()
        for group in opt.param_groups:
            group["lr"] = rec["lr"]
        opt.step()
        previous = rec["position"]
    return model.state_dict()


def consumed_exactly_once(history: dict[int, dict], length: int, epochs: int) -> None:
    """The logged positions tile the stream from 0 without a gap or an overlap, through
    ``epochs`` whole permutations: every sample once per epoch."""
    positions = [history[s]["position"] for s in range(1, max(history) + 1)]
    assert all(b > a for a, b in zip([0, *positions], positions, strict=False)), positions
    assert epochs * length <= positions[-1] < epochs * length + max(
        rec["world_size"] for rec in history.values())
