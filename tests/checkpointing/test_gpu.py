"""The CUDA snapshot path: pinned host buffers, copies on a side stream."""

from __future__ import annotations

import pytest
import torch

from checkpointing import CheckpointManager

from .helpers import assert_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("blocking", [True, False])
def test_cuda_state_round_trip_through_pinned_buffers(tmp_path, blocking):
    device = torch.device("cuda")
    model = torch.nn.Linear(256, 256).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 256, device=device)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    expected = {"model": {k: v.cpu() for k, v in model.state_dict().items()}}
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, blocking=blocking)
    if not blocking:
        buffers = manager._snapshotter._buffers
        assert buffers and all(b.is_pinned() and b.device.type == "cpu" for b in buffers.values())
        with torch.no_grad():  # the next step must not leak into the snapshot
            for p in model.parameters():
                p.add_(1.0)
    manager.wait()
    loaded = manager.load_latest()
    assert_same(loaded.state["model"], expected["model"])
    on_device = manager.load_latest(map_location="cuda")
    assert on_device.state["model"]["weight"].device.type == "cuda"
