"""The NCCL path: only where a CUDA device is present (skipped otherwise)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_nccl_process_group_ddp_step_and_step_boundary(monkeypatch):
    from trainer import dist as tdist
    from trainer.context import ElasticContext

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = ElasticContext.single_process(master_port=port)
    try:
        device = tdist.init_distributed(ctx)
        assert torch.distributed.get_backend() == "nccl"
        assert device == torch.device("cuda", 0)
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        model = tdist.wrap_ddp(torch.nn.Linear(4, 1), device)
        model(torch.randn(8, 4, device=device)).sum().backward()
        assert model.module.weight.grad.device == device
        stop, loss = tdist.step_boundary(True, 2.5, device)
        assert (stop, loss) == (True, 2.5)
        assert tdist.broadcast_int(7, device) == 7
    finally:
        tdist.shutdown()
