"""MLP regression (10 -> 50 -> 1) on synthetic data: the design card's example.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        trainer/examples/mlp.py --max-steps 5000 --checkpoint-dir /tmp/ckpt

The data is a pure function of ``--data-seed``, so every rank (and the replay
oracle of the tests) builds the same dataset without sharing files.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainer.examples import common
from trainer.exitcodes import exit_worker


def make_data(n: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` samples of y = sin(x . w) + 0.1 noise, x in R^10."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=gen, dtype=torch.float64)
    w = torch.randn(10, generator=gen, dtype=torch.float64)
    y = torch.sin(x @ w).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=gen, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def make_model(dtype: torch.dtype) -> nn.Module:
    return nn.Sequential(nn.Linear(10, 50), nn.Tanh(), nn.Linear(50, 1)).to(dtype)


def make_optimizer(model: nn.Module, lr: float, momentum: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def per_sample_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y, reduction="none").squeeze(1)


def main(argv: list[str] | None = None, on_model: Callable[[nn.Module], None] | None = None) -> int:
    """Train from the command line ``argv``; ``on_model`` is handed the module once it is
    built (seeded), for a caller that reads the weights this process ends with."""
    p = common.parser(__doc__.splitlines()[0], batch_size=16, lr=0.05)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--momentum", type=float, default=0.9)
    args = common.parse(p, argv)
    dtype = common.DTYPES[args.dtype]
    x, y = make_data(args.samples, args.data_seed, dtype)
    model = make_model(dtype)
    if on_model is not None:
        on_model(model)
    return common.train(
        args, model, make_optimizer(model, args.lr, args.momentum), len(x),
        batch_fn=lambda idx: (x[idx], y[idx]), loss_fn=per_sample_loss,
    )


if __name__ == "__main__":
    exit_worker(main())
