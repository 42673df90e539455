"""A training state from the rank that holds it to the ranks that need it, over the group.

What a join (or a survivor a step behind) takes from a live peer. The state's tensors go
as they are, each one ``dist.send`` of its bytes, and only the structure around them (the
dicts, lists and plain values, with a placeholder per tensor) is serialized
(``torch.save``; read back with ``weights_only=True``: nothing received is executed).
Measured with the former way, the whole state through ``torch.save`` and ``torch.load``
in memory: 1 GiB took 5.3-5.7 s against 1.2 s for its bytes alone over the same link
(``benchmarks/handover.py``), longer than the re-form's 5 s bound.

Tensors of other kinds (sparse, quantized, subclasses) and those inside containers other
than ``dict``, ``OrderedDict``, ``list`` and ``tuple`` stay in the serialized structure.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

_TENSOR = "__elasticd_tensor__"   # the placeholder's key: {_TENSOR: index}


def send_state(state: dict[str, Any] | None, holder: int, device: torch.device,
               needs: Sequence[int]) -> dict[str, Any]:
    """The holder's training state on the ranks in ``needs`` (the holder and each of them
    call this, the others nothing): the holder's ``state`` back to it, a copy to each of
    them, sent point to point (a rank at the newest step receives nothing). ``device``:
    the group's (a CUDA device under NCCL, the CPU under gloo); each tensor lands on the
    kind of device it was on at the holder (the receiver's own CUDA device for CUDA)."""
    if dist.get_rank() == holder:
        assert state is not None
        tensors: list[torch.Tensor] = []
        skeleton = _split(state, tensors)
        header = _header(skeleton, tensors, device)
        size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
        for rank in needs:
            dist.send(size, rank)
            dist.send(header, rank)
        for tensor in (t for t in tensors if t.numel()):
            raw = _bytes(tensor, device)   # once per tensor, whatever the receivers
            for rank in needs:
                dist.send(raw, rank)
        return state
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, holder)
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header, holder)
    meta = torch.load(io.BytesIO(header.cpu().numpy()), weights_only=True)
    received = [_receive(spec, holder, device) for spec in meta["tensors"]]
    return _join(meta["skeleton"], received)


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each plain strided tensor replaced by a placeholder (appended to ``tensors``)."""
    if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.is_quantized:
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1}
    if type(obj) in (dict, OrderedDict):
        return type(obj)((key, _split(value, tensors)) for key, value in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_split(value, tensors) for value in obj)
    return obj


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``_split`` undone: each placeholder replaced by its received tensor."""
    if type(obj) in (dict, OrderedDict):
        if len(obj) == 1 and _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        return type(obj)((key, _join(value, tensors)) for key, value in obj.items())
    if type(obj) in (list, tuple):
        return type(obj)(_join(value, tensors) for value in obj)
    return obj


def _header(skeleton: Any, tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    specs = [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
              "device": t.device.type} for t in tensors]
    buf = io.BytesIO()
    torch.save({"skeleton": skeleton, "tensors": specs}, buf)
    return torch.frombuffer(buf.getbuffer(), dtype=torch.uint8).to(device)


def _bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on the group's device (any dtype goes)."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


def _receive(spec: dict[str, Any], holder: int, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, str(spec["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the holder sent a tensor of unknown dtype {spec['dtype']!r}")
    shape = [int(n) for n in spec["shape"]]
    out = torch.empty(shape, dtype=dtype, device=device)
    if out.numel():
        raw = out.reshape(-1).view(torch.uint8)
        dist.recv(raw, holder)
    return out if spec["device"] != "cpu" or device.type == "cpu" else out.cpu()
