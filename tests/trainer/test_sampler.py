"""ElasticSampler: exactly once per epoch, whatever the world size and resumes did."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.batching import micro_batches, plan_batches, shard
from trainer.errors import CheckpointMismatch, ConfigError
from trainer.sampler import ElasticSampler, epoch_permutation

# One segment of a run: (world size, micro batch, accumulation?, steps, resume after?)
segments = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 7), st.booleans(), st.integers(0, 40),
              st.booleans()),
    min_size=1, max_size=8,
)


@pytest.mark.process
@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 120), seed=st.integers(0, 2**31), plan=segments)
def test_any_world_history_consumes_each_sample_once_per_epoch(n, seed, plan):
    sampler = ElasticSampler(n, seed=seed)
    seen: dict[int, list[int]] = {}
    for world, micro, accumulate, steps, resume in plan:
        batch = plan_batches(world, micro, global_batch=world * micro * 2 if accumulate else None)
        for _ in range(steps):
            epoch = sampler.epoch
            idx = sampler.next_indices(batch.global_batch)
            for rank in range(world):
                for part in micro_batches(shard(idx, world, rank), batch.accum):
                    seen.setdefault(epoch, []).extend(part.tolist())
            sampler.advance(len(idx))
        if resume:  # a new process restores the state and carries on
            state = sampler.state_dict()
            sampler = ElasticSampler(n, seed=seed)
            sampler.load_state_dict(state)
    for epoch, samples in seen.items():
        if epoch < sampler.epoch:
            assert sorted(samples) == list(range(n))  # every sample, once
        else:
            assert len(samples) == len(set(samples)) == sampler.cursor  # no repeats so far


def test_order_is_a_pure_function_of_seed_and_epoch():
    a, b = epoch_permutation(3, 0, 50), epoch_permutation(3, 0, 50)
    assert a.tolist() == b.tolist()
    assert a.tolist() != epoch_permutation(3, 1, 50).tolist()
    assert epoch_permutation(3, 0, 5, shuffle=False).tolist() == [0, 1, 2, 3, 4]


def test_last_step_of_an_epoch_is_short_and_never_padded():
    sampler = ElasticSampler(10, seed=0)
    sampler.advance(len(sampler.next_indices(8)))
    last = sampler.next_indices(8)
    assert len(last) == 2
    sampler.advance(2)
    assert (sampler.epoch, sampler.cursor) == (1, 0)


def test_state_is_plain_values_and_refuses_another_dataset():
    sampler = ElasticSampler(10, seed=4)
    sampler.advance(3)
    state = sampler.state_dict()
    assert all(type(v) in (int, bool) for v in state.values())
    with pytest.raises(CheckpointMismatch, match="dataset_len"):
        ElasticSampler(11, seed=4).load_state_dict(state)


def test_advance_must_match_the_step():
    sampler = ElasticSampler(10)
    with pytest.raises(ConfigError, match="advance by exactly"):
        sampler.advance(11)


def test_resume_matches_an_uninterrupted_order():
    straight = ElasticSampler(30, seed=9)
    order = []
    for _ in range(5):
        idx = straight.next_indices(7)
        order.extend(idx.tolist())
        straight.advance(len(idx))
    elastic, got = ElasticSampler(30, seed=9), []
    for batch in (7, 3, 12, 5, 8):  # other world sizes, same data order
        idx = elastic.next_indices(batch)
        got.extend(idx.tolist())
        elastic.advance(len(idx))
    assert got == order[: len(got)]
    assert np.array_equal(np.sort(got), np.arange(30))
