"""LR rescaling, the warm-up ramp, and re-applying the LR after an optimizer load."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.errors import ConfigError
from trainer.lr import LRScale, apply_lrs, base_lrs_of, lrs_at, scale_lr, start_scale


@pytest.mark.parametrize("rule, expected", [("linear", 0.3), ("sqrt", 0.1 * math.sqrt(3)),
                                            ("none", 0.1)])
def test_scale_lr_rules(rule, expected):
    assert scale_lr(0.1, 2, 6, rule) == pytest.approx(expected, rel=1e-15)


def test_scale_lr_rejects_unknown_rule_and_bad_sizes():
    with pytest.raises(ConfigError, match="linear, sqrt, none"):
        scale_lr(0.1, 2, 4, "cubic")
    with pytest.raises(ConfigError, match="world_size=0"):
        scale_lr(0.1, 2, 0, "linear")


def test_fresh_start_uses_first_world_as_base_and_no_ramp():
    scale = start_scale(None, 0, 4, "linear", warmup_steps=10)
    assert scale.base_world_size == 4 and scale.factor(0) == 1.0


def test_ramp_goes_from_previous_factor_to_new_in_k_steps():
    old = start_scale(None, 0, 2, "linear")                 # factor 1 at world 2
    new = start_scale(old, 100, 1, "linear", warmup_steps=4)  # to 0.5 at world 1
    assert [new.factor(s) for s in range(100, 106)] == [0.875, 0.75, 0.625, 0.5, 0.5, 0.5]


def test_ramp_interrupted_by_another_change_starts_from_the_factor_in_use():
    a = start_scale(None, 0, 2, "linear")
    b = start_scale(a, 10, 4, "linear", warmup_steps=4)      # 1 -> 2
    assert b.factor(11) == 1.5                                # last step before the change
    c = start_scale(b, 12, 1, "linear", warmup_steps=4)      # from 1.5 -> 0.5
    assert (c.ramp_from, c.ramp_to, c.factor(15)) == (1.5, 0.5, 0.5)
    assert c.factor(12) == pytest.approx(1.25)


def test_same_world_resume_continues_the_saved_ramp():
    a = start_scale(start_scale(None, 0, 2, "linear"), 10, 4, "linear", warmup_steps=4)
    resumed = start_scale(LRScale.from_state_dict(a.state_dict()), 12, 4, "linear",
                          warmup_steps=4)
    assert resumed == a


def test_explicit_base_world_size_wins():
    scale = start_scale(None, 0, 4, "linear", base_world_size=8)
    assert lrs_at([0.2, 0.02], scale, 0) == [0.1, 0.01]


def test_schedule_multiplies_the_scaled_lr():
    scale = start_scale(None, 0, 4, "linear", base_world_size=2)
    assert lrs_at([0.1], scale, 5, schedule=lambda step: 1 / (1 + step)) == [0.2 / 6]


def test_loading_optimizer_state_then_applying_restores_the_rescaled_lr():
    """Loading a state_dict brings back the OLD world's LR; apply_lrs must come after it."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    old_opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    scale_w2 = start_scale(None, 0, 2, "linear")
    apply_lrs(old_opt, lrs_at(base_lrs_of(old_opt), scale_w2, 0))
    saved = old_opt.state_dict()

    new_opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    base = base_lrs_of(new_opt)
    scale_w4 = start_scale(scale_w2, 50, 4, "linear")
    apply_lrs(new_opt, lrs_at(base, scale_w4, 50))
    new_opt.load_state_dict(saved)
    assert new_opt.param_groups[0]["lr"] == 0.1  # the pitfall: the rescale is undone
    apply_lrs(new_opt, lrs_at(base, scale_w4, 50))
    assert new_opt.param_groups[0]["lr"] == 0.2


def test_apply_lrs_checks_group_count():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ConfigError, match="param groups"):
        apply_lrs(opt, [0.1, 0.2])
