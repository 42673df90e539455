"""Learning-rate rescaling to the current world size, with an optional warm-up ramp.

The LR used for the update that takes the model from step ``s`` to ``s + 1`` is

    lr(s) = base_lr * schedule(s) * factor(s)

* ``base_lr``: the LR the script configured, meant for ``base_world_size`` workers;
* ``schedule``: an optional user multiplier (like ``LambdaLR``), a pure function of
  the step;
* ``factor``: the world-size rescale of ``scale_lr`` (linear, sqrt or none), ramped
  linearly over ``warmup_steps`` steps from the factor the previous world last used
  to the new world's factor whenever the world size changes.

Everything here is a pure function of saved state and the step, so a resume
recomputes exactly the LR the interrupted run would have used, and applying it
*after* the optimizer state is loaded means a stale LR in the optimizer's
state_dict can never undo the rescale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from elasticd.contract.settings import LR_RULES
from trainer.errors import ConfigError

Schedule = Callable[[int], float]


def scale_lr(base_lr: float, base_world_size: int, world_size: int, rule: str) -> float:
    """``base_lr`` (tuned for ``base_world_size`` workers) rescaled to ``world_size``.

    linear: ``base_lr * world_size / base_world_size`` (Goyal et al.);
    sqrt: ``base_lr * sqrt(world_size / base_world_size)`` (adaptive optimizers);
    none: ``base_lr``.
    """
    return base_lr * scale_factor(base_world_size, world_size, rule)


def scale_factor(base_world_size: int, world_size: int, rule: str) -> float:
    """The multiplier ``scale_lr`` applies."""
    if base_world_size < 1 or world_size < 1:
        raise ConfigError(
            f"world sizes must be >= 1 (base_world_size={base_world_size}, "
            f"world_size={world_size})"
        )
    ratio = world_size / base_world_size
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "none":
        return 1.0
    raise ConfigError(f"lr rule {rule!r} is unknown; use one of {', '.join(LR_RULES)}")


@dataclass(frozen=True)
class LRScale:
    """The world-size factor in force, and the ramp that leads to it (saved in checkpoints)."""

    rule: str
    base_world_size: int
    world_size: int
    warmup_steps: int = 0
    ramp_start: int = 0
    ramp_from: float = 1.0
    ramp_to: float = 1.0

    def factor(self, step: int) -> float:
        """The factor for the update from ``step`` to ``step + 1``.

        The ramp's k-th step (k = 0 .. warmup_steps - 1) uses
        ``from + (to - from) * (k + 1) / warmup_steps``: the last ramp step
        reaches the target, and no step repeats the old factor.
        """
        k = step - self.ramp_start
        if self.warmup_steps <= 0 or k >= self.warmup_steps - 1:
            return self.ramp_to
        k = max(k, 0)
        return self.ramp_from + (self.ramp_to - self.ramp_from) * (k + 1) / self.warmup_steps

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> LRScale:
        return cls(**{k: state[k] for k in cls.__dataclass_fields__})


def start_scale(
    saved: LRScale | None,
    step: int,
    world_size: int,
    rule: str,
    base_world_size: int | None = None,
    warmup_steps: int = 0,
) -> LRScale:
    """The scale for a (re)start at ``step`` with ``world_size`` workers.

    ``base_world_size`` defaults to the saved one, or on a fresh start to the
    first world's size (so the configured LR is the LR of the first world).
    A world that kept its size and its rule continues the saved ramp unchanged;
    otherwise a new ramp starts at ``step`` from the factor the previous world
    last used.
    """
    base = base_world_size or (saved.base_world_size if saved else world_size)
    target = scale_factor(base, world_size, rule)
    if saved is None:
        return LRScale(rule, base, world_size, warmup_steps, step, target, target)
    unchanged = (saved.world_size, saved.rule, saved.base_world_size) == (world_size, rule, base)
    if unchanged and saved.warmup_steps == warmup_steps:
        return saved
    previous = saved.factor(step - 1) if step > 0 else saved.ramp_to
    return LRScale(rule, base, world_size, warmup_steps, step, previous, target)


def lrs_at(
    base_lrs: Sequence[float], scale: LRScale, step: int, schedule: Schedule | None = None
) -> list[float]:
    """Per-param-group LRs for the update from ``step`` to ``step + 1``."""
    mult = scale.factor(step) * (schedule(step) if schedule else 1.0)
    return [base * mult for base in base_lrs]


def apply_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> None:
    """Write ``lrs`` into the optimizer's param groups (after any ``load_state_dict``)."""
    if len(lrs) != len(optimizer.param_groups):
        raise ConfigError(
            f"{len(lrs)} learning rates for {len(optimizer.param_groups)} param groups; "
            "build the optimizer with the same param groups on every (re)start"
        )
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr


def base_lrs_of(optimizer: torch.optim.Optimizer) -> list[float]:
    """The configured LRs of a freshly built optimizer (read before loading its state)."""
    return [float(group["lr"]) for group in optimizer.param_groups]
