"""The divergence rule: a loss that stays non-finite ends the run instead of a crash loop.

A NaN or infinite loss is not a fault the restart path can repair: a restart resumes
the last checkpoint and replays the same samples on the same weights, so it diverges
again at the same step (seen in the goodput benchmark: 18 restarts, no step past 1240).
``DivergenceCheck`` counts the *agreed* losses (the all-reduced global mean, the same
on every rank, so every rank decides alike at the same step) that are not finite in a
row; at ``limit`` it raises ``TrainingDiverged``. One non-finite loss is tolerated by
default (mixed precision's scaler skips such a step and goes on). ``limit == 0``
disables the rule.
"""

from __future__ import annotations

import math

from trainer.errors import TrainingDiverged


class DivergenceCheck:
    """Consecutive non-finite agreed losses; ``observe`` raises at ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"nonfinite_loss_limit={limit} must be >= 0 (0: never stop)")
        self.limit = limit
        self.count = 0
        self.first_step: int | None = None

    def observe(self, loss: float, step: int) -> None:
        """Record the agreed ``loss`` of ``step``; raises ``TrainingDiverged`` at the limit."""
        if math.isfinite(loss):
            self.count, self.first_step = 0, None
            return
        self.count += 1
        if self.first_step is None:
            self.first_step = step
        if self.limit and self.count >= self.limit:
            raise TrainingDiverged(
                f"the training diverged: the agreed loss was {loss} at {self.count} agreements "
                f"in a row (steps {self.first_step}..{step}); a restart from the last "
                "checkpoint would replay the same data on the same weights. Fix: lower the "
                "learning rate (or its world-size rescale: [lr] rule / base_world_size), or "
                "raise ELASTICD_NONFINITE_LOSS_LIMIT ([supervisor] nonfinite_loss_limit, 0 "
                "disables the check) if non-finite losses are expected, then restart the job")
