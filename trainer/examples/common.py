"""What every example script shares: its command line and the hand-over to ElasticTrainer.

Every ``ELASTICD_*`` setting can also be given as an argument; an argument wins
over the environment (the daemon sets the environment, a plain torchrun user
may use either).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import timedelta

import torch

from trainer.context import LR_RULES, ElasticContext
from trainer.logs import configure_logging
from trainer.loop import BatchFn, ElasticTrainer, LossFn, TrainConfig

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def parser(description: str, *, batch_size: int, lr: float) -> argparse.ArgumentParser:
    """The arguments every example takes; a script adds its own model arguments."""
    p = argparse.ArgumentParser(description=description)
    run = p.add_argument_group("run")
    run.add_argument("--max-steps", type=int, default=1000)
    run.add_argument("--max-epochs", type=int, default=None)
    run.add_argument("--batch-size", type=int, default=batch_size, help="per rank per micro-step")
    run.add_argument("--global-batch", type=int, default=None,
                     help="constant-global-batch mode: fixed global batch via accumulation")
    run.add_argument("--lr", type=float, default=lr, help="LR at the base world size")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    run.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    run.add_argument("--log-every", type=int, default=10)
    run.add_argument("--collective-timeout-s", type=float, default=120.0)
    run.add_argument("--log-level", default="info")
    env = p.add_argument_group("elastic settings (override the ELASTICD_* environment)")
    env.add_argument("--checkpoint-dir")
    env.add_argument("--checkpoint-every-steps", type=int)
    env.add_argument("--checkpoint-every-s", type=float)
    env.add_argument("--keep-last", type=int)
    env.add_argument("--lr-rule", choices=LR_RULES)
    env.add_argument("--lr-base-world-size", type=int)
    env.add_argument("--lr-warmup-steps", type=int)
    env.add_argument("--stop-file")
    env.add_argument("--progress-file")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, configure logging and seed (the model is built from this seed on every rank)."""
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    torch.manual_seed(args.seed)
    return args


def context(args: argparse.Namespace) -> ElasticContext:
    """torchrun's and elasticd's environment, with the command line's overrides."""
    return ElasticContext.from_env().with_overrides(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every_steps=args.checkpoint_every_steps,
        checkpoint_every_s=args.checkpoint_every_s,
        keep_last=args.keep_last,
        lr_rule=args.lr_rule,
        lr_base_world_size=args.lr_base_world_size,
        lr_warmup_steps=args.lr_warmup_steps,
        stop_file=args.stop_file,
        progress_file=args.progress_file,
    )


def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset_len: int,
    batch_fn: BatchFn,
    loss_fn: LossFn,
) -> int:
    """Run the elastic loop with the command line's settings; returns the exit code."""
    config = TrainConfig(
        micro_batch=args.batch_size,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        global_batch=args.global_batch,
        seed=args.seed,
        log_every=args.log_every,
        step_sleep_s=args.step_sleep,
        timeout=timedelta(seconds=args.collective_timeout_s),
    )
    trainer = ElasticTrainer(model, optimizer, dataset_len, batch_fn, loss_fn, config,
                             ctx=context(args))
    return trainer.run()
