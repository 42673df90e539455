"""Pure parts of the training loop: checkpoint cadence, device moves, dataset adapter."""

from __future__ import annotations

import numpy as np
import torch

from trainer.loop import checkpoint_due, dataset_batch_fn, to_device


def test_checkpoint_cadence_by_steps_and_or_seconds():
    assert checkpoint_due(10, 0.0, 5, None) and not checkpoint_due(11, 0.0, 5, None)
    assert checkpoint_due(11, 30.0, None, 30.0) and not checkpoint_due(11, 29.9, None, 30.0)
    assert checkpoint_due(11, 31.0, 5, 30.0)  # either trigger
    assert not checkpoint_due(10, 1e9, None, None)  # no cadence: stop/final saves only


def test_batches_move_to_the_device_and_datasets_adapt():
    batch = to_device({"x": (torch.ones(2), [torch.zeros(1)]), "n": 3}, torch.device("cpu"))
    assert batch["n"] == 3 and isinstance(batch["x"], tuple)
    data = [(torch.tensor([float(i)]), i) for i in range(10)]
    x, y = dataset_batch_fn(data)(np.array([3, 7]))
    assert x.tolist() == [[3.0], [7.0]] and y.tolist() == [3, 7]
