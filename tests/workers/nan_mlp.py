"""The MLP example on a node with a fault: once the file named by ``NAN_ARM`` exists,
this process' next loss is NaN (one step, as a bit flip or a broken device would make
it), then the example goes on as usual (tests/daemon/test_nonfinite_runs.py)."""

from __future__ import annotations

import os

import torch

from trainer.examples import mlp
from trainer.exitcodes import exit_worker

ARM = os.environ.get("NAN_ARM")
_fired = False
_loss = mlp.per_sample_loss


def faulty_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    global _fired
    loss = _loss(model, batch)
    if ARM and not _fired and os.path.exists(ARM):
        _fired = True
        print(f"nan_mlp: NaN injected (pid {os.getpid()})", flush=True)
        return loss * float("nan")
    return loss


if __name__ == "__main__":
    mlp.per_sample_loss = faulty_loss
    exit_worker(mlp.main())
