"""Exactly-once, resumable data order that does not depend on the world size.

``ElasticSampler`` owns one deterministic permutation of the whole dataset per
(seed, epoch) and a *global* cursor into it. Each optimizer step the current
world takes the next ``global_batch`` indices of the permutation (``next_indices``)
and splits them over ranks (``batching.shard``); once the step is done every rank
calls ``advance`` with the same count. The cursor, not the world, defines the
position, so any sequence of world sizes and resumes consumes every sample of an
epoch exactly once.

Unlike torch's DistributedSampler there is no padding: the last step of an epoch
is *short* (it takes the remaining ``len % global_batch`` samples, spread over
the ranks as evenly as possible) and never crosses into the next epoch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.errors import CheckpointMismatch, ConfigError


def epoch_permutation(seed: int, epoch: int, length: int, shuffle: bool = True) -> np.ndarray:
    """The dataset order of ``epoch``: a pure function of (seed, epoch, length)."""
    if not shuffle:
        return np.arange(length, dtype=np.int64)
    # Seeding with the pair keeps epochs independent without any seed arithmetic.
    return np.random.default_rng([seed, epoch]).permutation(length).astype(np.int64)


class ElasticSampler:
    """A global cursor over per-epoch permutations; see the module docstring."""

    def __init__(self, dataset_len: int, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_len < 1:
            raise ConfigError(f"dataset_len={dataset_len} is invalid: the dataset is empty")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    def permutation(self) -> np.ndarray:
        """This epoch's order (computed once per epoch)."""
        if self._perm_epoch != self.epoch:
            self._perm = epoch_permutation(self.seed, self.epoch, self.dataset_len, self.shuffle)
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    @property
    def remaining(self) -> int:
        """Samples of the current epoch not consumed yet."""
        return self.dataset_len - self.cursor

    def next_indices(self, global_batch: int) -> np.ndarray:
        """The next step's global indices: ``global_batch`` of them, fewer at epoch end.

        Does not move the cursor: call ``advance(len(indices))`` once the step is done,
        so a step that fails is taken again on resume.
        """
        if global_batch < 1:
            raise ConfigError(f"global_batch={global_batch} is invalid: expected >= 1")
        return self.permutation()[self.cursor : self.cursor + global_batch]

    def advance(self, count: int) -> None:
        """Mark ``count`` samples consumed; the epoch rolls over when it is exhausted."""
        if not 0 < count <= self.remaining:
            raise ConfigError(
                f"advance({count}) with {self.remaining} samples left in epoch {self.epoch}: "
                "advance by exactly len(next_indices(...))"
            )
        self.cursor += count
        if self.cursor == self.dataset_len:
            self.epoch += 1
            self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools, safe to load with ``weights_only=True``."""
        return {
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; refuse a state saved for another dataset or seed."""
        saved = (int(state["dataset_len"]), int(state["seed"]), bool(state["shuffle"]))
        if saved != (self.dataset_len, self.seed, bool(self.shuffle)):
            raise CheckpointMismatch(
                f"sampler state was saved for (dataset_len, seed, shuffle)={saved}, this run has "
                f"{(self.dataset_len, self.seed, self.shuffle)}: resume with the same data and "
                "seed, or start from an empty checkpoint directory"
            )
        cursor = int(state["cursor"])
        if not 0 <= cursor < self.dataset_len:
            raise CheckpointMismatch(f"sampler cursor {cursor} is outside [0, {self.dataset_len})")
        self.epoch = int(state["epoch"])
        self.cursor = cursor
