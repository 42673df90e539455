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

from elasticd.contract import settings as worker_contract
from trainer.context import ElasticContext
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
    add_contract_flags(p)
    return p


def add_contract_flags(p: argparse.ArgumentParser) -> None:
    """One flag per worker-contract setting (``--keep-last`` for ``ELASTICD_KEEP_LAST``, ...).

    Generated from ``elasticd.contract.settings.FIELDS``, so a new setting gets its flag
    without an edit here. A flag left out keeps the environment's value (default None).
    """
    env = p.add_argument_group("elastic settings (override the ELASTICD_* environment)")
    for f in worker_contract.FIELDS:
        meta = f.metadata
        default = "" if f.default is None else f" (default {f.default})"
        env.add_argument(
            worker_contract.flag_name(f), dest=f.name, default=None,
            type=_flag_type(f), choices=meta["choices"] or None,
            help=f"{meta['help']}; overrides {worker_contract.env_name(f)}{default}",
        )


def _flag_type(f):
    """argparse type: the contract's own parser, so flags and variables accept the same text."""
    def convert(raw: str):
        try:
            return worker_contract.parse(f, raw)
        except worker_contract.WorkerContractError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse, configure logging and seed (the model is built from this seed on every rank)."""
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    torch.manual_seed(args.seed)
    return args


def context(args: argparse.Namespace) -> ElasticContext:
    """torchrun's and elasticd's environment, with the command line's overrides."""
    return ElasticContext.from_env().with_overrides(
        **{name: getattr(args, name) for name in worker_contract.FIELD_NAMES}
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
