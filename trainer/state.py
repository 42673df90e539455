"""What a trainer checkpoint holds, and how it is restored.

Only tensors and plain values (the checkpoint loads with ``weights_only=True``).
There is no RNG state: randomness inside a step is reseeded from
(seed, step, rank) at every step (``step_seed``), so a resume at any world size
draws exactly what a run without the interruption would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.errors import CheckpointMismatch
from trainer.lr import LRScale
from trainer.sampler import ElasticSampler

FORMAT_VERSION = 1


@dataclass
class TrainState:
    """The live, resumable state of a run: what a checkpoint of ``step`` captures."""

    model: torch.nn.Module  # the unwrapped module
    optimizer: torch.optim.Optimizer
    sampler: ElasticSampler
    step: int = 0
    scale: LRScale | None = None
    lrs_used: list[float] | None = None
    world_size: int = 1
    global_batch: int = 0

    def to_checkpoint(self) -> dict[str, Any]:
        """The nested dict handed to ``CheckpointManager.save``."""
        assert self.scale is not None
        return {
            "format": FORMAT_VERSION,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "lr": {"scale": self.scale.state_dict(), "lrs_used": list(self.lrs_used or [])},
            "world": {"world_size": self.world_size, "global_batch": self.global_batch},
        }

    def load_checkpoint(self, saved: dict[str, Any], step: int) -> LRScale:
        """Restore model, optimizer and data position; return the saved LR scale.

        The optimizer's param-group LRs come back stale; the caller re-applies the
        rescaled LR right after this.
        """
        if saved.get("format") != FORMAT_VERSION or saved.get("step") != step:
            raise CheckpointMismatch(
                f"checkpoint of step {step} has format {saved.get('format')!r} and step "
                f"{saved.get('step')!r}; it was not written by this trainer version: use a "
                "fresh checkpoint directory"
            )
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.sampler.load_state_dict(saved["sampler"])
        self.step = step
        self.lrs_used = [float(x) for x in saved["lr"]["lrs_used"]]
        return LRScale.from_state_dict(saved["lr"]["scale"])


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` during ``step``: independent streams, reproducible on resume."""
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0] >> 1)
