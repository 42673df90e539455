"""A start-up check of the private torch APIs the etcd3 rendezvous plugin relies on.

torch's dynamic rendezvous has no public extension points for what the plugin and the
daemon do (read and edit the pickled state, fail fast in heartbeats, leave or close the
rendezvous on shutdown), so they use private names. A torch upgrade that renames one
would otherwise fail deep inside a rendezvous round, on every node at once; this check
fails at start instead, naming what is missing.
"""

from __future__ import annotations

import inspect

import structlog

from elasticd.errors import ElasticdError

log = structlog.get_logger(__name__)

# Tested: 2.13.0 (the default lane) and 2.14.1 (`make compat`); 2.15 by the same lane where
# the machine's pip allows it (`make compat COMPAT_TORCH=2.15.0`). torch's
# dynamic_rendezvous is byte-identical in 2.13 and 2.14; 2.15 adds only
# RendezvousSettings.cas_backoff_max_seconds (see ``supports_cas_backoff``). The names below
# are what the range is about; widen it only after the rendezvous tests pass on the new
# version. The range in pyproject.toml is the same one.
SUPPORTED_RANGE = ">=2.13,<2.16"
_SUPPORTED = ((2, 13), (2, 16))

_DYN = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
# (module, dotted attribute, why we need it)
_REQUIRED: tuple[tuple[str, str, str], ...] = (
    (_DYN, "_RendezvousState", "the pickled state (state_ops, restricted unpickler)"),
    (_DYN, "_NodeDesc", "a node in the state (state_ops, restricted unpickler)"),
    (_DYN, "_BackendRendezvousStateHolder", "the state cache the woken poll bypasses (handler)"),
    (_DYN, "_remove_participant_epilogue", "torch's rule after removing a participant (evict)"),
    (_DYN, "_get_timeout", "--rdzv-conf *_timeout parsing (create_handler)"),
    (_DYN, "_RendezvousExitOp", "leaving the rendezvous on a failed shutdown (handler)"),
    (_DYN, "RendezvousTimeout", "the handler's timeouts (create_handler)"),
    (_DYN, "RendezvousBackend", "base class of the etcd3 backend"),
    (_DYN, "DynamicRendezvousHandler.from_backend", "building the handler"),
    (_DYN, "DynamicRendezvousHandler._keep_alive", "fail-fast heartbeats (handler)"),
    (_DYN, "DynamicRendezvousHandler._close", "closing on success only (handler.shutdown)"),
    (_DYN, "DynamicRendezvousHandler._stop_heartbeats", "handler.shutdown"),
    (_DYN, "DynamicRendezvousHandler._get_deadline", "handler.shutdown"),
    (_DYN, "DynamicRendezvousHandler.use_agent_store", "no shared TCPStore (handler)"),
    (_DYN, "_delay", "the round's poll, woken by an etcd watch instead of 1 s sleeps (handler)"),
    ("torch.distributed.elastic.rendezvous", "RendezvousStateError", "reporting a corrupt state"),
    ("torch.distributed.elastic.rendezvous", "RendezvousConnectionError", "reporting etcd errors"),
    ("torch.distributed.elastic.rendezvous", "RendezvousParameters", "--rdzv-conf"),
)
# Attributes of a fresh _RendezvousState that the state operations read and write.
_STATE_FIELDS = ("round", "complete", "deadline", "closed", "participants", "wait_list",
                 "redundancy_list", "last_heartbeats")
_NODE_FIELDS = ("addr", "pid", "local_id")
# Attributes of the state holder the woken poll uses (set in torch's __init__).
_HOLDER_INIT_ATTRS = ("_backend", "_last_sync_time")
# Attributes of a handler instance used by the subclass (set in torch's __init__).
_HANDLER_INIT_ATTRS = ("_this_node", "_settings", "_op_executor", "_heartbeat_lock",
                       "_state_holder")


class TorchCompatError(ElasticdError):
    """The installed torch lacks a private API the etcd3 rendezvous plugin relies on."""


def check_torch_apis() -> None:
    """Raise ``TorchCompatError`` naming the installed torch and every missing name."""
    import importlib

    import torch

    missing: list[str] = []
    for module_name, dotted, why in _REQUIRED:
        try:
            obj = importlib.import_module(module_name)
        except ImportError:
            missing.append(f"module {module_name} ({why})")
            continue
        for part in dotted.split("."):
            if not hasattr(obj, part):
                missing.append(f"{module_name}.{dotted} ({why})")
                break
            obj = getattr(obj, part)
    if not missing:
        missing += _missing_fields()
    version = str(torch.__version__)
    if missing:
        raise TorchCompatError(
            f"torch {version} lacks what the etcd3 rendezvous plugin needs: "
            f"{'; '.join(missing)}. Supported torch: {SUPPORTED_RANGE}; install a supported "
            f"version (e.g. pip install 'torch{SUPPORTED_RANGE}')"
        )
    if not _in_range(version):
        log.warning("torch version outside the tested range; the private APIs are present",
                    torch=version, supported=SUPPORTED_RANGE)


def supports_cas_backoff() -> bool:
    """torch 2.15's ``from_backend(..., cas_backoff_max_seconds=)``: decided by the signature
    of the installed torch, not by its version string."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    try:
        params = inspect.signature(dyn.DynamicRendezvousHandler.from_backend).parameters
    except (TypeError, ValueError):
        return False
    return "cas_backoff_max_seconds" in params


def reconfigure_api() -> bool:
    """torch 2.14's process-group reconfigure API (``init_process_group(enable_reconfigure=)``,
    ``_reconfigure``, ``_get_reconfigure_handle``, ``_supports_reconfigure``): asked of the
    installed torch, not of its version string. The in-place re-form uses it where a
    backend supports it (``trainer.reform``)."""
    import torch.distributed as dist

    names = ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure")
    if not all(hasattr(dist, n) for n in names):
        return False
    try:
        params = inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):
        return False
    return "enable_reconfigure" in params


def nccl2_backend() -> bool:
    """torch registers ``nccl2`` (its reconfigurable NCCL backend) as a backend of its own."""
    from importlib.metadata import entry_points

    return any(e.name == "nccl2" for e in entry_points(group="torch.distributed.backends"))


def _missing_fields() -> list[str]:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    missing = []
    state = dyn._RendezvousState()
    missing += [f"{_DYN}._RendezvousState().{f} (state_ops)" for f in _STATE_FIELDS
                if not hasattr(state, f)]
    node_fields = getattr(dyn._NodeDesc, "__dataclass_fields__", {})
    missing += [f"{_DYN}._NodeDesc.{f} (state_ops)" for f in _NODE_FIELDS if f not in node_fields]
    init_source = _source(dyn.DynamicRendezvousHandler.__init__)
    if init_source is not None:
        missing += [f"{_DYN}.DynamicRendezvousHandler.{a} (handler)" for a in _HANDLER_INIT_ATTRS
                    if f"self.{a}" not in init_source]
    holder_source = _source(dyn._BackendRendezvousStateHolder.__init__)
    if holder_source is not None:
        missing += [f"{_DYN}._BackendRendezvousStateHolder.{a} (handler's woken poll)"
                    for a in _HOLDER_INIT_ATTRS if f"self.{a}" not in holder_source]
    return missing


def _source(fn: object) -> str | None:
    try:
        return inspect.getsource(fn)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None   # no source installed: the attribute check is skipped, not failed


def _in_range(version: str) -> bool:
    try:
        major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    low, high = _SUPPORTED
    return low <= (major, minor) < high
