"""The training state's transfer between live ranks (trainer.transfer) over a real gloo group."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer import transfer

REPO = Path(__file__).resolve().parents[2]


def _state() -> dict:
    gen = torch.Generator().manual_seed(7)
    return {
        "model": OrderedDict(w=torch.randn(3, 4, generator=gen, dtype=torch.float64),
                             b=torch.randn(4, generator=gen).to(torch.bfloat16)),
        "optimizer": {"state": {0: {"step": torch.tensor(12.0), "exp_avg": torch.zeros(0)}},
                      "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        "mask": torch.tensor([True, False, True]),
        "view": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),   # not contiguous
        "rng": torch.Generator().manual_seed(3).get_state(),
        "pairs": (1, "two", [torch.ones(2, dtype=torch.int32)]),
        "sparse": torch.eye(3).to_sparse(),   # stays in the serialized structure
        "step": 40,
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(b) is type(a) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.to_dense() if a.is_sparse else a, b.to_dense() if b.is_sparse else b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    cpu = torch.device("cpu")
    if rank == 0:
        transfer.send_state(_state(), 0, cpu, [2])
    elif rank == 2:
        got = transfer.send_state(None, 0, cpu, [2])
        Path(out).write_text("same" if _same(_state(), got) else f"differs: {got!r}")
    dist.barrier()   # rank 1 (at the newest step) took no part, and is not waited on
    dist.destroy_process_group()


def test_a_state_reaches_the_rank_that_needs_it_bit_for_bit_with_its_types(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "result.txt"
    code = "import sys; from tests.trainer.test_transfer import _rank; _rank(int(sys.argv[1]), {}, {!r})"
    ranks = [subprocess.Popen([sys.executable, "-c", code.format(port, str(out)), str(r)], cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=str(REPO))) for r in range(3)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0, 0]
    assert out.read_text() == "same"


def test_the_structure_keeps_its_containers_and_replaces_only_plain_tensors():
    tensors: list[torch.Tensor] = []
    skeleton = transfer._split(_state(), tensors)
    assert len(tensors) == 8 and isinstance(skeleton["model"], OrderedDict)
    assert skeleton["sparse"].is_sparse and skeleton["step"] == 40
    assert _same(transfer._join(skeleton, tensors), _state())


@pytest.mark.parametrize("name", ["load", "no_such_name"])
def test_a_header_naming_no_dtype_is_refused_not_looked_up_as_code(name):
    with pytest.raises(ValueError, match=f"unknown dtype '{name}'"):
        transfer._receive({"dtype": name, "shape": [1], "device": "cpu"}, 0, torch.device("cpu"))


def test_the_header_reads_back_with_weights_only():
    header = transfer._header({"a": {transfer._TENSOR: 0}}, [torch.ones(2)], torch.device("cpu"))
    meta = torch.load(io.BytesIO(header.numpy()), weights_only=True)
    assert meta["tensors"] == [{"dtype": "float32", "shape": [2], "device": "cpu"}]
