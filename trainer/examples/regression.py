"""The seed-style job's parts, shared by ``ddp_plain.py`` and ``ddp_elastic.py``.

The data and model are the mlp example's (10 -> 50 -> 1 regression on synthetic
data, a pure function of ``--data-seed``), wrapped in a ``TensorDataset`` for a
standard ``DataLoader``; the LR schedule is the usual linear warm-up into a cosine
decay, built from torch's own schedulers. ``warmup_cosine_factor`` is its closed form
(the tests check the logged LR against it).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.data import TensorDataset

from trainer.examples import common, mlp


def arguments(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The job's command line (plus the ``ELASTICD_*`` override flags, which the plain
    script accepts and ignores)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--cosine-steps", type=int, default=400)
    p.add_argument("--warmup-start", type=float, default=0.1, help="warm-up start factor")
    p.add_argument("--dtype", choices=sorted(common.DTYPES), default="float32")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of 'compute' per step")
    p.add_argument("--snapshot", default=None, help="the plain script's own rank-0 save")
    p.add_argument("--log-every", type=int, default=10)
    common.add_contract_flags(p)
    return p.parse_args(argv)


def make_dataset(args: argparse.Namespace) -> TensorDataset:
    x, y = mlp.make_data(args.samples, args.data_seed, common.DTYPES[args.dtype])
    return TensorDataset(x, y)


def make_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    return mlp.make_model(common.DTYPES[args.dtype])


def warmup_cosine(optimizer: torch.optim.Optimizer, args: argparse.Namespace
                  ) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up from ``warmup_start`` x LR over ``warmup_steps``, then cosine to 0."""
    sched = torch.optim.lr_scheduler
    warmup = sched.LinearLR(optimizer, start_factor=args.warmup_start, end_factor=1.0,
                            total_iters=args.warmup_steps)
    cosine = sched.CosineAnnealingLR(optimizer, T_max=args.cosine_steps)
    return sched.SequentialLR(optimizer, [warmup, cosine], milestones=[args.warmup_steps])


def warmup_cosine_factor(step: int, warmup_steps: int, cosine_steps: int, start: float) -> float:
    """The schedule's multiplier of the LR for the update from ``step`` (closed form)."""
    if step < warmup_steps:
        return start + (1.0 - start) * step / warmup_steps
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup_steps) / cosine_steps))
