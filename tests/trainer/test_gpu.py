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


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="NCCL allows one rank per GPU: needs 3")
def test_nccl_survivors_reform_in_place_after_a_rank_is_killed(tmp_path):
    """The in-place path on NCCL: 3 ranks on 3 GPUs, rank 2 SIGKILLed, the survivors are
    released by the record (the communicator is aborted), re-form and complete."""
    from elasticd import proctree
    from tests.trainer.test_inplace import World, _final_matches_the_replay

    world = World(tmp_path, 3, "--max-steps=60", "--step-sleep=0.02", gpu=True)
    try:
        world.wait_step(10)
        proctree.kill_tree(world.worker("n2").proc.pid)
        world.lose("n2")
        assert world.wait("n0") == 0 and world.wait("n1") == 0
        _final_matches_the_replay(world, "n0", 60)
    finally:
        world.close()


def test_an_nccl_group_reconfigures_where_torch_can(monkeypatch):
    """One GPU, one rank: the group is created the way ``auto`` plans for NCCL (reconfigurable
    through ``nccl2`` where torch has it, else destroy + init), steps, and re-forms into the
    next generation through a store hosted here (a survivor's daemon's, in a real job)."""
    from datetime import timedelta

    import torch.distributed as dist

    from elasticd.contract.generation import GenerationId, GenerationRecord, renumber
    from trainer import reform

    timeout = timedelta(seconds=30)
    world = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    nxt = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    backend = reform.nccl_backend()
    try:
        got = reform.create_group(backend, world, 0, 1, GenerationId(0, 0, "g"), timeout, device)
        assert got == reform.planned_mechanism("nccl")
        x = torch.ones(4, device=device)
        dist.all_reduce(x)
        record = GenerationRecord(GenerationId(0, 1, "g"), renumber([("n0", 1)]),
                                  store=f"127.0.0.1:{nxt.port}")
        mech = reform.mechanism_for(backend, [])
        mech.leave(10.0)
        mech.join(record, 0, backend, device, timeout, 10.0, newer=lambda: None)
        dist.all_reduce(x)
        assert x.sum().item() == 4.0
    finally:
        from trainer import dist as tdist

        tdist.shutdown()
