"""How an in-place re-form rebuilds the process group: mechanisms chosen by capability.

* ``reconfigure``: torch's reconfigure API (torch 2.14+; gloo, and NCCL through the
  ``nccl2`` backend, the default ``nccl`` on 2.15). The worker creates its default group
  once with ``enable_reconfigure=True`` (no communicator yet) and every generation,
  the first included, is one ``dist._reconfigure(uuid, handles)`` on that same group:
  the process, its group object and the DDP-visible ``WORLD`` stay; only the
  communicator changes. Measured here (gloo, 2.14.1): a group of three shrank to two in
  1-3 ms and grew back by a brand-new process in 2-9 ms.
* ``destroy-init``: abandon the old group (abort it, drop it from torch's registry,
  keep its objects alive) and ``init_process_group`` anew through the generation's
  store. The only way on torch 2.13, on NCCL's legacy backend and for a group the
  script created itself.
* ``renew``: a reconfigurable gloo group whose collectives may be stuck (released from
  a frozen peer, or left unfinished after a crash) is left (as by destroy + init) and a
  new reconfigurable group is created in the generation (``Renew`` says why).

The choice is made when the group is created, by asking torch, not by reading its
version: ``reconfigure_api()`` (the functions exist) and, after the group exists,
``dist._supports_reconfigure()`` (its backend took the flag; backends that cannot
reconfigure ignore it and form the group as always). ``ELASTICD_REFORM=destroy-init``
forces the fallback.

Why a store of our own (``GenerationStore``): the reconfigure API forms each new
communicator through the store the group was *created* with. torchrun's store is
hosted by the first world's rank 0: once that node is lost, a group created on it
could never form again (measured: ``DistNetworkError``, broken pipe). The group is
therefore created on a ``GenerationStore``, a Python ``Store`` that forwards to the
store of the current generation (the one its record names, hosted by a survivor's
daemon, under the generation's own prefix), so every re-form forms where the
destroy + init path forms too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from elasticd.contract.generation import GenerationId, GenerationRecord
from elasticd.rendezvous.torch_compat import nccl2_backend, reconfigure_api
from trainer import inplace

RECONFIGURE = "reconfigure"
DESTROY_INIT = "destroy-init"
# A reconfigurable group whose collectives may be stuck (gloo: the guard released the waiters
# on a frozen peer, or left collectives unfinished) is left and a new one created (``Renew``).
RENEW = "renew"

# Under a generation's store prefix: each member's reconfigure handle, by its new rank.
HANDLE_KEY = "elasticd.handle/"


def nccl_backend() -> str:
    """The NCCL backend to create a reconfigurable group with: ``nccl2`` where torch ships
    it as a backend of its own (2.14: opt-in; the legacy ``nccl`` cannot reconfigure),
    else ``nccl`` (2.15: ``nccl`` is nccl2; 2.13: destroy + init anyway)."""
    return "nccl2" if reconfigure_api() and nccl2_backend() else "nccl"


def planned_mechanism(backend: str, stuck: bool = False) -> str:
    """What ``auto`` will re-form a ``backend`` group with, as far as torch can tell before
    a group exists: reconfigure where the API is there (for NCCL: and ``nccl2`` too);
    ``stuck``: when the old group's collectives may be stuck (``mechanism_for``)."""
    if not reconfigure_api():
        return DESTROY_INIT
    if inplace.is_nccl(backend):
        return RECONFIGURE if nccl_backend() == "nccl2" else DESTROY_INIT
    return RENEW if stuck else RECONFIGURE


def generation_uuid(gen: GenerationId) -> int:
    """The communicator id of a generation: the same on every member, fresh for each
    re-form of a process's group (``(round, seq)`` only grows within a worker's life)."""
    return (gen.round << 24) | gen.seq


class GenerationStore(dist.Store):
    """A ``Store`` that forwards to the current generation's store (see the module
    docstring). ``follow`` points it at another; gloo's reconfigure reads it then."""

    def __init__(self, target: dist.Store) -> None:
        super().__init__()
        self.target = target

    def follow(self, target: dist.Store) -> None:
        self.target = target

    def set(self, key: str, value: Any) -> None:
        self.target.set(key, value)

    def get(self, key: str) -> bytes:
        return self.target.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.target.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.target.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.target.wait(keys)
        else:
            self.target.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.target.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.target.delete_key(key)

    def num_keys(self) -> int:
        return self.target.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.target.set_timeout(timeout)

    # The C++ names torch's pybind trampoline calls from a PrefixStore.
    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self.delete_key(key)


class Mechanism(Protocol):
    """One way of moving this worker's default group to a new generation."""

    name: str

    def leave(self, seconds: float) -> None:
        """Let go of the old group (once per re-form, before the first ``join``)."""

    def join(self, record: GenerationRecord, rank: int, backend: str, device: torch.device,
             timeout: timedelta, seconds: float,
             newer: Callable[[], GenerationRecord | None]) -> None:
        """Form ``record``'s group as ``rank``; ``inplace.Superseded`` if ``newer()`` names a
        later generation before every member arrived; bounded by ``seconds``."""


class DestroyInit:
    """Abandon the old group, init a new one through the generation's store."""

    name = DESTROY_INIT

    def __init__(self, backend: str, retain: list[object]) -> None:
        self.backend = backend
        self.retain = retain

    def leave(self, seconds: float) -> None:
        inplace.abandon_group(self.retain, self.backend, seconds)

    def join(self, record: GenerationRecord, rank: int, backend: str, device: torch.device,
             timeout: timedelta, seconds: float,
             newer: Callable[[], GenerationRecord | None]) -> None:
        inplace.join_group(record, rank, backend, device, timeout, seconds, newer=newer)


class Reconfigure:
    """Reconfigure the one default group (created on ``store``) for each generation."""

    name = RECONFIGURE

    def __init__(self, store: GenerationStore) -> None:
        self.store = store

    def leave(self, seconds: float) -> None:
        """Nothing to let go of: the next reconfigure replaces the communicator (chosen
        only when no collective of the old one could be stuck: ``mechanism_for``)."""

    def join(self, record: GenerationRecord, rank: int, backend: str, device: torch.device,
             timeout: timedelta, seconds: float,
             newer: Callable[[], GenerationRecord | None]) -> None:
        deadline = time.monotonic() + seconds
        target = inplace.generation_store(record, seconds)
        self.form(target, record.id, rank, record.world_size, deadline, newer, timeout)

    def form(self, target: dist.Store, gen: GenerationId, rank: int, world_size: int,
             deadline: float, newer: Callable[[], GenerationRecord | None],
             timeout: timedelta) -> None:
        """Publish this member's handle in ``target``, wait for every member's, and
        reconfigure the default group to ``world_size`` ranks in ``gen``."""
        self.store.follow(target)
        target.set(f"{HANDLE_KEY}{rank}", dist._get_reconfigure_handle())
        inplace.await_members(target, world_size, f"generation {gen}", deadline, newer)
        handles = [target.get(f"{HANDLE_KEY}{r}").decode() for r in range(world_size)]
        left = max(deadline - time.monotonic(), 0.1)
        inplace.bounded(
            lambda: dist._reconfigure(generation_uuid(gen), handles,
                                      timeout=timedelta(seconds=min(left, timeout.total_seconds()))
                                      ).wait(),
            left, f"reconfiguring the group for generation {gen}")


class Renew(DestroyInit):
    """Leave the old group (as destroy + init does) and create a new reconfigurable one
    in the generation, beside members that reconfigure theirs (both meet in its store).

    Why: a gloo group runs its collectives on two worker threads, and a collective stuck
    on a frozen peer keeps its thread until the group's timeout; with two stuck (the
    stop agreement in flight and a gradient bucket: the usual case after a release) the
    reconfigure itself never runs (measured on 2.14.1: it hung until the bound, abort()
    did not free them). A new group has threads of its own. A crash can leave them stuck
    too: a survivor whose own collective failed gives up its side of the others, and a
    peer's collective waiting on it stays unfinished; the guard counts them."""

    name = RENEW

    def join(self, record: GenerationRecord, rank: int, backend: str, device: torch.device,
             timeout: timedelta, seconds: float,
             newer: Callable[[], GenerationRecord | None]) -> None:
        if dist.is_initialized():  # made by an earlier try, whose record was superseded
            mechanism_for(backend, self.retain).join(record, rank, backend, device, timeout,
                                                     seconds, newer)
            return
        join_as_newcomer(record, rank, backend, device, timeout, seconds, newer=newer)


def mechanism_for(backend: str, retain: list[object], stuck: bool = False) -> Mechanism:
    """The mechanism for the current default group: reconfigure it where it was created
    reconfigurable (``create_group``), unless its collectives may be stuck (``stuck``: the
    guard let go of waiters on a frozen peer, or collectives it started are unfinished;
    gloo only, nccl2's reconfigure tears the old communicator down): then ``Renew``;
    destroy + init for any other group."""
    store = _CREATED.get("store")
    if store is not None and dist.is_initialized() and dist._supports_reconfigure():
        if stuck and not inplace.is_nccl(backend):
            return Renew(backend, retain)
        return Reconfigure(store)
    return DestroyInit(backend, retain)


# The GenerationStore of the group ``create_group`` made, if it made a reconfigurable one.
_CREATED: dict[str, GenerationStore] = {}


def create_group(backend: str, world_store: dist.Store, rank: int, world_size: int,
                 gen: GenerationId, timeout: timedelta, device_id: torch.device | None,
                 mechanism: str = "auto",
                 newer: Callable[[], GenerationRecord | None] = lambda: None) -> str:
    """Create the default group of generation ``gen`` through ``world_store`` (its keys
    under the generation's prefix); the re-form mechanism it allows.

    With ``mechanism="auto"`` and the API present, the group is created reconfigurable
    on a ``GenerationStore`` over ``world_store`` and formed by a first reconfigure; a
    backend that ignored the flag formed it already (destroy + init from then on).
    Otherwise it is a plain ``init_process_group``.
    """
    _CREATED.clear()
    if mechanism == DESTROY_INIT or not reconfigure_api():
        dist.init_process_group(backend=backend, store=world_store, rank=rank,
                                world_size=world_size, timeout=timeout, device_id=device_id)
        return DESTROY_INIT
    store = GenerationStore(world_store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device_id, enable_reconfigure=True)
    if not dist._supports_reconfigure():
        return DESTROY_INIT
    _CREATED["store"] = store
    Reconfigure(store).form(dist.PrefixStore(gen.store_prefix, world_store), gen, rank,
                            world_size, time.monotonic() + timeout.total_seconds(),
                            newer, timeout)
    return RECONFIGURE


def join_as_newcomer(record: GenerationRecord, rank: int, backend: str,
                     device: torch.device, timeout: timedelta, seconds: float,
                     mechanism: str = "auto",
                     newer: Callable[[], GenerationRecord | None] = lambda: None) -> str:
    """A process with no group yet enters ``record``'s group beside its survivors (who
    re-form with their own mechanism: both meet in the generation's store); the mechanism
    its group then has. Bounded by ``seconds``."""
    if mechanism == DESTROY_INIT or planned_mechanism(backend) == DESTROY_INIT:
        inplace.join_group(record, rank, backend, device, timeout, seconds, newer=newer)
        return DESTROY_INIT
    client = inplace.store_client(record, seconds)
    return create_group(backend, client, rank, record.world_size, record.id,
                        timedelta(seconds=min(seconds, timeout.total_seconds())),
                        device if device.type == "cuda" else None, mechanism, newer)


__all__ = ["DESTROY_INIT", "RECONFIGURE", "RENEW", "DestroyInit", "Renew", "GenerationStore", "Mechanism",
           "Reconfigure", "create_group", "generation_uuid", "join_as_newcomer", "mechanism_for",
           "nccl_backend", "planned_mechanism"]
