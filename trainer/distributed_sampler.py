"""A drop-in, elastic replacement for ``torch.utils.data.DistributedSampler``.

``ElasticDistributedSampler`` takes DistributedSampler's arguments and works in a
standard ``DataLoader`` loop (``set_epoch`` every loader epoch), but its position is
*global*, so a job can stop at any step and resume at another world size without
repeating or skipping a sample. The training loop tells it what was consumed:
``advance(n)`` once per optimizer step, with the samples *this rank* consumed (the
same ``n`` on every rank).

Semantics (N = ``len(dataset)``, W = ``num_replicas``, r = ``rank``):

* **Stream.** The data order is the concatenation of the epoch permutations
  ``epoch_permutation(seed, 0, N)``, ``epoch_permutation(seed, 1, N)``, ... (no
  shuffle: ``arange(N)`` each time). Stream position ``p`` is dataset index
  ``perm(seed, p // N)[p % N]`` (``stream_indices``).
* **Position.** The sampler holds ``position`` G, the number of stream samples
  consumed by the whole world (independent of W), and the loader ``epoch`` e.
* **Iteration.** ``__iter__`` starts at G0 = G. With R = (e + 1) * N - G0 samples left
  in permutation e: if R <= 0 it yields nothing (that loader epoch is already done,
  e.g. a resumed loop that restarts from epoch 0); otherwise every rank yields
  L = ceil(R / W) items (``floor`` with ``drop_last``), rank r the stream positions
  G0 + r + W * i for i in range(L). This is DistributedSampler's strided
  ``rank::num_replicas`` layout: the first m items of all ranks together are exactly
  the stream range [G0, G0 + W * m), so ``advance(n)`` moves G by W * n whatever the
  batch size.
* **Epoch edges.** Without ``drop_last`` the last up to W - 1 positions of an epoch
  spill into permutation e + 1 (the next iteration starts after them, at G); with
  ``drop_last`` the up to W - 1 left-over positions of permutation e come first in
  loader epoch e + 1. A new ``__iter__`` always restarts at the current G, so items
  that were yielded but never consumed (a DataLoader's dropped partial batch, an
  iteration broken off) come first next time.
* **Exactly once.** Unlike DistributedSampler, which pads an epoch by repeating
  samples (or drops the tail with ``drop_last``), no sample is ever duplicated or
  dropped: every stream position is consumed exactly once, in stream order, so a
  loader epoch holds *about* N samples rather than exactly one permutation.

``set_epoch(e)`` treats a position more than one whole permutation behind
(``G // N < e - 1``) as epochs the caller skipped: G jumps to e * N with a warning
that counts the skipped samples. A loop that calls ``set_epoch`` every epoch lags
less than one global batch (W * b) behind, so this fires only when the caller jumps
epochs, or when a dropping DataLoader (or sampler) meets a global batch (or world)
larger than the dataset, which leaves DistributedSampler without batches too.

``state_dict()`` is plain ints and bools; ``load_state_dict`` refuses a state saved
for another dataset length, seed or shuffle, and accepts any world size (and
``drop_last``: this run's setting wins).

The DataLoader iterates the sampler in the main process (workers only receive
indices), so ``advance`` on the rank's sampler object is all the bookkeeping needed;
the positions an iteration yields are fixed when ``__iter__`` is called (a DataLoader
does so at its first batch fetch), so prefetching batches changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from functools import partial
from typing import Any

import numpy as np
import structlog
import torch.distributed as dist
from torch.utils.data import Sampler

from trainer.errors import CheckpointMismatch, ConfigError
from trainer.sampler import epoch_permutation

log = structlog.get_logger(__name__)

# Items converted to Python ints at a time: a 1M-sample epoch never becomes one big list.
_YIELD_CHUNK = 65536


def stream_indices(
    seed: int,
    length: int,
    shuffle: bool,
    start: int,
    count: int,
    *,
    permutation: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """Dataset indices of stream positions [start, start + count) (int64).

    A pure function of its arguments. ``permutation(k)`` may supply the order of
    permutation k (a cache); it must equal ``epoch_permutation(seed, k, length, shuffle)``.
    """
    if length < 1:
        raise ConfigError(f"length={length} is invalid: the dataset is empty")
    if start < 0 or count < 0:
        raise ConfigError(f"stream range start={start}, count={count} is invalid: both must be >= 0")
    perm = permutation or partial(epoch_permutation, seed, length=length, shuffle=shuffle)
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:  # one slice copy per permutation the range touches
        k, offset = divmod(start + filled, length)
        take = min(length - offset, count - filled)
        out[filled : filled + take] = perm(k)[offset : offset + take]
        filled += take
    return out


class ElasticDistributedSampler(Sampler[int]):
    """DistributedSampler's interface over a global, resumable stream position.

    See the module docstring for the semantics. ``epoch`` is the loader epoch last
    set; ``position`` the stream samples consumed by the whole world.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "ElasticDistributedSampler needs num_replicas and rank: call "
                    "torch.distributed.init_process_group() first, or pass both explicitly"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ConfigError(f"num_replicas={num_replicas} is invalid: pass the world size (>= 1)")
        if not 0 <= rank < num_replicas:
            raise ConfigError(
                f"rank={rank} is invalid for num_replicas={num_replicas}: "
                f"pass a rank in [0, {num_replicas - 1}]"
            )
        try:
            length = len(dataset)
        except TypeError:
            raise ConfigError(
                "ElasticDistributedSampler needs a map-style dataset with __len__; "
                f"got {type(dataset).__name__}"
            ) from None
        if length < 1:
            raise ConfigError(f"len(dataset)={length} is invalid: pass a dataset with at least one sample")
        self.dataset_len = length
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._position = 0
        # The current iteration: where it started and its per-rank length; None until
        # the next one is planned (set_epoch / load_state_dict invalidate it).
        self._start: int | None = None
        self._length = 0
        self._consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def position(self) -> int:
        """Stream samples consumed by the whole world (world-size independent)."""
        return self._position

    def _length_from(self, start: int) -> int:
        """Per-rank items of loader epoch ``self.epoch`` when it starts at ``start``."""
        left = (self.epoch + 1) * self.dataset_len - start
        if left <= 0:
            return 0
        w = self.num_replicas
        return left // w if self.drop_last else math.ceil(left / w)

    def _plan(self) -> None:
        """Fix the current iteration at the current position, nothing consumed yet."""
        self._start = self._position
        self._length = self._length_from(self._position)
        self._consumed = 0

    def _permutation(self, k: int) -> np.ndarray:
        perm = self._perms.get(k)
        if perm is None:
            perm = epoch_permutation(self.seed, k, self.dataset_len, self.shuffle)
            self._perms[k] = perm
        return perm

    def __iter__(self) -> Iterator[int]:
        # Not a generator function: the start is fixed when the iterator is made, not
        # at its first next(), so an iterator made before an advance() still yields the
        # positions its len() promised. (A DataLoader calls this at its first batch fetch.)
        self._plan()
        assert self._start is not None
        # Permutations behind the start are never read again; the cache spans one iteration.
        first = self._start // self.dataset_len
        self._perms = {k: p for k, p in self._perms.items() if k >= first}
        w = self.num_replicas
        block = stream_indices(self.seed, self.dataset_len, self.shuffle, self._start,
                               w * self._length, permutation=self._permutation)
        return _as_ints(block[self.rank :: w])

    def __len__(self) -> int:
        """Items this rank yields in the current (or, before it starts, the next) iteration."""
        if self._start is None:
            return self._length_from(self._position)
        return self._length

    @property
    def remaining(self) -> int:
        """Items of the current iteration this rank has not consumed yet."""
        if self._start is None:
            self._plan()
        return self._length - self._consumed

    def advance(self, n: int) -> None:
        """Record that this rank consumed its next ``n`` items (every rank the same ``n``).

        Call once per optimizer step with ``len(batch)``; the position moves by
        ``num_replicas * n``.
        """
        if not 0 <= n <= self.remaining:
            raise ConfigError(
                f"advance({n}) with {self.remaining} items left in this iteration (loader epoch "
                f"{self.epoch}): advance by the number of samples this rank took, once per step"
            )
        self._consumed += n
        self._position += self.num_replicas * n

    def set_epoch(self, epoch: int) -> None:
        """Set the loader epoch; skip (with a warning) permutations the caller jumped over."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ConfigError(f"set_epoch({epoch!r}) is invalid: pass the loader epoch, an int >= 0")
        self.epoch = epoch
        self._start = None
        if self._position // self.dataset_len < epoch - 1:
            target = epoch * self.dataset_len
            log.warning(
                "set_epoch skipped samples: the position is more than one permutation behind "
                "the loader epoch; call set_epoch for every epoch, or load_state_dict on resume",
                epoch=epoch, position=self._position, skipped_samples=target - self._position,
            )
            self._position = target

    def reshard(self, num_replicas: int, rank: int) -> None:
        """Continue at the same position in a world of ``num_replicas`` as ``rank`` (an
        in-place re-form): the next iteration is laid out for the new world."""
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigError(f"reshard({num_replicas}, {rank}) is invalid: pass the new world "
                              "size (>= 1) and a rank in [0, world size)")
        self.num_replicas, self.rank = num_replicas, rank
        self._start = None

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools, safe to load with ``weights_only=True``; the same on every rank."""
        return {
            "dataset_len": self.dataset_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position, at any world size; refuse another dataset or seed."""
        mine = {"dataset_len": self.dataset_len, "seed": self.seed, "shuffle": self.shuffle}
        saved = {"dataset_len": int(state["dataset_len"]), "seed": int(state["seed"]),
                 "shuffle": bool(state["shuffle"])}
        differ = [f"{key} (saved {saved[key]}, now {mine[key]})" for key in mine if saved[key] != mine[key]]
        if differ:
            raise CheckpointMismatch(
                f"sampler state was saved for another data order: {', '.join(differ)}; resume with "
                "the same dataset, seed and shuffle, or start from an empty checkpoint directory"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or position < 0:
            raise CheckpointMismatch(
                f"sampler state has epoch={epoch}, position={position}: both must be >= 0"
            )
        self.epoch = epoch
        self._position = position
        self._start = None


def _as_ints(indices: np.ndarray) -> Iterator[int]:
    for begin in range(0, len(indices), _YIELD_CHUNK):
        yield from indices[begin : begin + _YIELD_CHUNK].tolist()
