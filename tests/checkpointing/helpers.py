"""Shared test helpers: deterministic states, deep comparison, a fault-injecting storage."""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from typing import Any

import torch

from checkpointing import LocalStorage
from checkpointing.storage import translate_os_error


def make_state(step: int, numel: int = 1 << 16) -> dict[str, Any]:
    """A training-like state whose every value depends on `step` (so content names its step)."""
    gen = torch.Generator().manual_seed(step)
    model = OrderedDict(
        weight=torch.randn(numel, generator=gen),
        bias=torch.full((64,), float(step)),
    )
    return {
        "model": model,
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(numel // 4,
                                                                                   generator=gen)}},
            "param_groups": [{"lr": 0.1 / (step + 1), "betas": (0.9, 0.999), "params": [0, 1]}],
        },
        "rng": torch.get_rng_state() if step < 0 else torch.arange(16, dtype=torch.uint8) + step,
        "sampler": {"epoch": step // 10, "position": step * 32, "name": f"step-{step}"},
        "flags": [True, None, 1.5, "x"],
    }


def assert_same(actual: Any, expected: Any, path: str = "state") -> None:
    """Deep equality with exact tensor comparison (dtype, shape and values)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, path
        assert torch.equal(actual, expected), f"{path}: tensor values differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


class FaultyStorage(LocalStorage):
    """LocalStorage that fails like a real disk would: ENOSPC after a byte budget, or
    refused removals. Errors go through the same translation as real OSErrors."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.space_left: int | None = None  # bytes writable before ENOSPC; None = unlimited
        self.fail_removals = False

    def open_write(self, path: str, expect=None):
        inner = super().open_write(path, expect)
        outer = self

        class Budgeted:
            def write(self, data):
                if outer.space_left is not None:
                    if len(data) > outer.space_left:
                        raise translate_os_error(
                            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "write", path)
                    outer.space_left -= len(data)
                return inner.write(data)

            def commit(self):
                inner.commit()

            def abort(self):
                inner.abort()

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                inner.abort()

        return Budgeted()

    def remove(self, path: str) -> None:
        if self.fail_removals:
            raise translate_os_error(OSError(errno.EACCES, "Permission denied"), "remove", path)
        super().remove(path)
