"""Validate a state and snapshot it to host memory.

The snapshot is what the background writer serializes while training goes on, so it must
share nothing mutable with the live state: containers are rebuilt and tensors are copied
into host buffers. The buffers are allocated on the first save and reused by later saves
whose tensors at the same place in the dict have the same shape and dtype (a fresh
allocation of GBs costs several times the copy itself: page faults on first touch).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .errors import UnsupportedStateError

Path = tuple[Any, ...]
_LEAF_TYPES = (type(None), bool, int, float, str)
_KEY_TYPES = (type(None), bool, int, float, str)
_SUPPORTED = "only tensors, numbers, str, bool, None, lists, tuples and dicts are saved"
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def format_path(path: Path) -> str:
    """`state['optimizer']['param_groups'][0]` for ('optimizer', 'param_groups', 0)."""
    return "state" + "".join(f"[{key!r}]" for key in path)


def _check_tensor(tensor: torch.Tensor, path: Path) -> None:
    where = format_path(path)
    if type(tensor) not in _TENSOR_TYPES:
        raise UnsupportedStateError(
            f"{where} is a {type(tensor)} (a tensor subclass); {_SUPPORTED}; "
            "convert it to a plain torch.Tensor first"
        )
    if tensor.layout != torch.strided or tensor.is_quantized:
        raise UnsupportedStateError(
            f"{where} is a tensor with layout {tensor.layout}; only dense tensors are saved; "
            "convert it with .to_dense() (or dequantize it) first"
        )
    if tensor.device.type == "meta":
        raise UnsupportedStateError(f"{where} is on the meta device and holds no data")


def _check_key(key: Any, path: Path) -> None:
    if type(key) not in _KEY_TYPES:
        raise UnsupportedStateError(
            f"{format_path(path)} has a key {key!r} of {type(key)}; "
            "dict keys must be str, int, float, bool or None"
        )


TensorFn = Callable[[torch.Tensor, Path], torch.Tensor]


def rebuild(obj: Any, on_tensor: TensorFn, path: Path = ()) -> Any:
    """A copy of `obj` with fresh containers and each tensor replaced by on_tensor(t, path).

    Raises UnsupportedStateError naming the path of the first object that cannot be saved.
    """
    kind = type(obj)
    if kind in _LEAF_TYPES:
        return obj
    if isinstance(obj, torch.Tensor):
        _check_tensor(obj, path)
        return on_tensor(obj, path)
    if kind is dict or kind is collections.OrderedDict:
        return _rebuild_dict(obj, on_tensor, path)
    if kind is list:
        return [rebuild(v, on_tensor, (*path, i)) for i, v in enumerate(obj)]
    if kind is tuple or kind is torch.Size:
        return kind(rebuild(v, on_tensor, (*path, i)) for i, v in enumerate(obj))
    raise UnsupportedStateError(f"{format_path(path)} is a {kind}; {_SUPPORTED}")


def _rebuild_dict(obj: dict[Any, Any], on_tensor: TensorFn, path: Path) -> dict[Any, Any]:
    out = type(obj)()
    for key, value in obj.items():
        _check_key(key, path)
        out[key] = rebuild(value, on_tensor, (*path, key))
    # nn.Module.state_dict() carries per-module versions in `_metadata`; load_state_dict
    # uses them to upgrade old formats, so they travel with the dict.
    metadata = getattr(obj, "_metadata", None)
    if isinstance(metadata, dict):
        out._metadata = rebuild(metadata, on_tensor, (*path, "_metadata"))  # type: ignore[attr-defined]
    return out


def _is_compact(tensor: torch.Tensor) -> bool:
    """True if torch.save of `tensor` writes exactly its elements (not a larger storage)."""
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )


def host_view(state: Any) -> Any:
    """The state with fresh containers and tensors on the CPU, shared where already there.

    For a blocking save: the caller waits, so the live tensors can be written directly.
    """
    memo: dict[int, torch.Tensor] = {}

    def on_tensor(tensor: torch.Tensor, path: Path) -> torch.Tensor:
        if id(tensor) not in memo:
            detached = tensor.detach()
            if detached.device.type != "cpu" or not _is_compact(detached):
                detached = detached.to("cpu", copy=True, memory_format=torch.contiguous_format)
            memo[id(tensor)] = detached
        return memo[id(tensor)]

    return rebuild(state, on_tensor)


class Snapshotter:
    """Copies states into reusable host buffers (pinned, with a side stream, on CUDA).

    Not thread-safe; the returned tree aliases the buffers, so it is valid until the next
    `snapshot()` call (the manager never snapshots while a write of the last one runs).
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: dict[Path, torch.Tensor] = {}
        self._streams: dict[torch.device, Any] = {}
        self.allocated_bytes = 0

    def snapshot(self, state: Any) -> Any:
        """Validate `state`, copy its tensors into the buffers, return the rebuilt tree."""
        old, new = self._buffers, {}
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        memo: dict[int, torch.Tensor] = {}

        def on_tensor(tensor: torch.Tensor, path: Path) -> torch.Tensor:
            if id(tensor) not in memo:
                buffer = self._buffer_for(old.get(path), tensor)
                new[path] = buffer
                pairs.append((buffer, tensor))
                memo[id(tensor)] = buffer
            return memo[id(tensor)]

        tree = rebuild(state, on_tensor)  # validates everything before copying anything
        self._buffers = new
        self._copy(pairs)
        return tree

    def release(self) -> None:
        """Drop the buffers (the next snapshot allocates again)."""
        self._buffers = {}

    def _buffer_for(self, current: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        if current is not None and current.shape == like.shape and current.dtype == like.dtype:
            return current
        self.allocated_bytes += like.numel() * like.element_size()
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self._pin)

    def _copy(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for dst, src in pairs:
            by_device.setdefault(src.device, []).append((dst, src))
        with torch.no_grad():
            for device, group in by_device.items():
                if device.type == "cuda":
                    self._copy_cuda(device, group)
                else:
                    for dst, src in group:
                        dst.copy_(src)

    def _copy_cuda(self, device: torch.device, group: list[tuple[torch.Tensor, torch.Tensor]]):
        # A side stream lets the device-to-host copies overlap kernels already queued on the
        # compute stream; it first waits for that stream so it copies the finished values.
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for dst, src in group:
                dst.copy_(src, non_blocking=self._pin)
        # The snapshot must be complete before save() returns: the next optimizer step may
        # overwrite the sources.
        stream.synchronize()
