"""The MLP example made heavy: a slow start-up and a training state of about 1 GB.

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        trainer/examples/heavy.py --max-steps 500 --startup-delay-s 5 --state-mb 1024

Stands in for a real job whose every worker start costs seconds before the first
step (CUDA/NCCL initialisation, compilation) and whose state is large, at the
compute of the MLP (so three nodes fit on two cores):

* ``--startup-delay-s``: the worker sleeps this long before it builds its model;
* ``--state-mb``: a frozen parameter of that size next to the MLP (a frozen embedding
  table, say). It is in every checkpoint (a restart loads it) and DDP broadcasts it
  once when it wraps the model, as it does every weight; it has no gradient, so a
  step's all-reduce and optimizer are the MLP's.

Data, model and optimizer are ``mlp.py``'s with its default settings.
"""

from __future__ import annotations

import time

import structlog
import torch
from torch import nn

from trainer.examples import common, mlp
from trainer.exitcodes import exit_worker

log = structlog.get_logger(__name__)

SAMPLES, DATA_SEED, MOMENTUM = 4096, 1234, 0.9


class Heavy(nn.Module):
    """``mlp.make_model`` plus ``frozen``: ``state_bytes`` of zeros that never change."""

    def __init__(self, dtype: torch.dtype, state_bytes: int) -> None:
        super().__init__()
        self.mlp = mlp.make_model(dtype)
        numel = max(state_bytes // torch.empty((), dtype=dtype).element_size(), 1)
        self.frozen = nn.Parameter(torch.zeros(numel, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's checkpointed tensors."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def build(args) -> tuple[Heavy, torch.optim.Optimizer]:  # noqa: ANN001 - argparse.Namespace
    """The model and its optimizer (over the MLP's parameters only)."""
    model = Heavy(common.DTYPES[args.dtype], int(args.state_mb * 2**20))
    return model, mlp.make_optimizer(model.mlp, args.lr, MOMENTUM)


def arguments(argv: list[str] | None = None):  # noqa: ANN201 - argparse.Namespace
    p = common.parser(__doc__.splitlines()[0], batch_size=16, lr=0.05)
    p.add_argument("--startup-delay-s", type=float, default=5.0,
                   help="sleep before building the model (stands in for device init, compile)")
    p.add_argument("--state-mb", type=float, default=1024.0,
                   help="MiB of frozen, checkpointed parameters")
    return common.parse(p, argv)


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    log.info("start-up delay", seconds=args.startup_delay_s)
    time.sleep(args.startup_delay_s)
    x, y = mlp.make_data(SAMPLES, DATA_SEED, common.DTYPES[args.dtype])
    model, optimizer = build(args)
    return common.train(args, model, optimizer, len(x), batch_fn=lambda idx: (x[idx], y[idx]),
                        loss_fn=mlp.per_sample_loss)


if __name__ == "__main__":
    exit_worker(main())
