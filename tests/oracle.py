"""The replay oracle: a run's logged per-step world sizes and LRs, replayed on one process.

Every step of the MLP example is one SGD update on the step's whole global batch (the
loop averages over it exactly, whatever the split), so a fault-free single-process
replay of the same (world size, LR) history must reach the same parameters. The data
order is the sampler's: per-epoch permutations and a global cursor, so a replay that
matches also used every sample exactly once per epoch.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from trainer.distributed_sampler import stream_indices
from trainer.examples import mlp, regression
from trainer.sampler import epoch_permutation


@dataclass(frozen=True)
class Run:
    """The example's settings that the replay needs (what the script was given)."""

    samples: int
    batch: int
    lr: float
    seed: int
    data_seed: int
    momentum: float

    def args(self) -> list[str]:
        return ["--dtype=float64", f"--samples={self.samples}", f"--batch-size={self.batch}",
                f"--lr={self.lr}", f"--seed={self.seed}", f"--data-seed={self.data_seed}",
                f"--momentum={self.momentum}"]


def lineage(records: Iterable[dict]) -> dict[int, dict]:
    """Step -> the progress record of each step that counts: a resume discards later steps.

    ``records``: progress records of the rank-0 lineage in the order they were written.
    """
    history: dict[int, dict] = {}
    for rec in records:
        if rec["event"] == "resumed":
            history = {s: v for s, v in history.items() if s <= rec["step"]}
        elif rec["event"] in ("step", "checkpoint"):
            history[rec["step"]] = rec
    return history


def step_history(records: Iterable[dict]) -> dict[int, tuple[int, float]]:
    """Step -> (world size, LR) of the steps that count (see ``lineage``)."""
    return {s: (rec["world_size"], rec["lr"]) for s, rec in lineage(records).items()}


def replay(run: Run, history: dict[int, tuple[int, float]]) -> dict[str, torch.Tensor]:
    """One process, plain torch: each step is one update on the world's whole global batch."""
    torch.manual_seed(run.seed)
    x, y = mlp.make_data(run.samples, run.data_seed, torch.float64)
    model = mlp.make_model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=run.momentum)
    epoch, cursor = 0, 0
    for step in range(1, max(history) + 1):
        world, lr = history[step]
        perm = epoch_permutation(run.seed, epoch, run.samples)
        idx = perm[cursor : cursor + world * run.batch]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        cursor += len(idx)
        if cursor == run.samples:
            epoch, cursor = epoch + 1, 0
    return model.state_dict()


def max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, ref in want.items():
        diff = (got[name] - ref).abs() / ref.abs().clamp_min(1e-12)
        worst = max(worst, float(diff.max()))
    return worst


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
