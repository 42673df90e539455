"""Batch plans: per-rank batch, constant global batch, and how shares are split."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainer.batching import micro_batches, plan_batches, shard
from trainer.errors import ConfigError


def test_per_rank_batch_mode_grows_with_the_world():
    assert plan_batches(3, 8).global_batch == 24
    assert plan_batches(3, 8).accum == 1


@pytest.mark.parametrize("world, accum", [(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)])
def test_constant_global_batch_uses_accumulation(world, accum):
    plan = plan_batches(world, 8, global_batch=96)
    assert (plan.accum, plan.global_batch) == (accum, 96)


def test_indivisible_global_batch_says_what_to_choose():
    with pytest.raises(ConfigError) as err:
        plan_batches(5, 8, global_batch=96)
    msg = str(err.value)
    assert "global_batch=96 is not divisible by world_size*micro_batch=5*8" in msg
    assert "multiple of 40" in msg and "[1, 2, 3, 4, 6, 12]" in msg


def test_shares_differ_by_at_most_one_and_cover_the_step():
    idx = np.arange(10, 15)  # a short last step: 5 samples over 3 ranks
    shares = [shard(idx, 3, r) for r in range(3)]
    assert [len(s) for s in shares] == [2, 2, 1]
    assert np.concatenate(shares).tolist() == idx.tolist()
    assert len(shard(idx[:1], 2, 1)) == 0  # a rank may get nothing at epoch end


def test_micro_batches_cover_the_share():
    parts = micro_batches(np.arange(7), 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]



@given(st.integers(0, 200), st.integers(1, 17))
def test_shards_and_micro_batches_cut_as_array_split_cuts(n, parts):
    items = np.arange(n) * 3
    want = np.array_split(items, parts)
    assert [shard(items, parts, r).tolist() for r in range(parts)] == [w.tolist() for w in want]
    assert [m.tolist() for m in micro_batches(items, parts)] == [w.tolist() for w in want]
