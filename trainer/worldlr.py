"""The world-size LR rescale, applied around ``optimizer.step()`` by optimizer hooks.

The script (or its torch LR scheduler) owns the *unscaled* LR in the optimizer's
param groups, exactly as it would without elasticd. A step pre-hook multiplies it
by the world-size factor of ``trainer.lr.LRScale`` for the update being taken; the
post-hook puts the unscaled value back. So:

* any torch scheduler (``LambdaLR``, ``CosineAnnealingLR``'s recursive form,
  ``OneCycleLR``, ``SequentialLR`` warm-up chains, ``ReduceLROnPlateau``) reads and
  writes only unscaled LRs and never compounds the rescale;
* a checkpoint taken between steps holds the unscaled LR and the scheduler's own
  state, so a resume at another world size continues the schedule at the right step
  and applies the new world's factor on top;
* ``applied`` is the LR each param group really used for the last update (what
  progress records and the replay oracle log).

``ElasticTrainer`` passes its ``lr_schedule`` (a multiplier of the configured LRs; a
constant 1 without one): the unscaled LR is then ``base * schedule(step)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.lr import LRScale, Schedule


class WorldLR:
    """The hooks on one optimizer; ``scale`` and the step counter are read at each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, scale: Callable[[], LRScale],
                 step: Callable[[], int], schedule: Schedule | None = None) -> None:
        self.optimizer = optimizer
        self._scale = scale
        self._step = step
        # With a schedule the unscaled LR of step s is base * schedule(s), whatever the
        # param groups hold (a loaded optimizer state's LR then never matters).
        self._schedule = schedule
        self._base = [float(g["lr"]) for g in optimizer.param_groups]
        self._unscaled: list[float] | None = None
        self.applied: list[float] = [float(g["lr"]) for g in optimizer.param_groups]
        self.updates = 0  # optimizer steps completed (whether the weights moved since a mark)
        self._handles = [optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post)]

    def preview(self, step: int | None = None) -> list[float]:
        """The LRs the next update (or the update from ``step``) would use."""
        step = self._step() if step is None else step
        factor = self._scale().factor(step)
        return [u * factor for u in self.unscaled(step)]

    def unscaled(self, step: int | None = None) -> list[float]:
        """The LRs as the script and its scheduler see them (of ``step``, with a schedule)."""
        if self._schedule is not None:
            mult = self._schedule(self._step() if step is None else step)
            return [base * mult for base in self._base]
        if self._unscaled is not None:  # inside a step (or a step that raised)
            return list(self._unscaled)
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def remove(self) -> None:
        """Take the hooks off (the param groups keep their unscaled LRs)."""
        self._restore()
        for handle in self._handles:
            handle.remove()

    def _pre(self, optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        # A previous step that raised never reached the post-hook: start from its
        # unscaled LRs, not from the scaled ones it left behind (no compounding).
        self._restore()
        self._unscaled = self.unscaled()
        self.applied = self.preview()
        for group, lr in zip(optimizer.param_groups, self.applied, strict=True):
            group["lr"] = lr

    def _post(self, _optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
        self.updates += 1
        self._restore()

    def _restore(self) -> None:
        if self._unscaled is None:
            return
        for group, lr in zip(self.optimizer.param_groups, self._unscaled, strict=True):
            group["lr"] = lr
        self._unscaled = None
