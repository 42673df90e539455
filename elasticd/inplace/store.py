"""The TCP store each survivor hosts for its whole life, published as ``store``.

A re-formed group forms through the store of its new rank 0's host (its daemon, or its
companion under plain torchrun), so it never depends on a lost node's store (torchrun's
store lives in the rank-0 agent, and the etcd store in the agents' rendezvous).
"""

from __future__ import annotations

from datetime import timedelta

import structlog

from elasticd.contract.generation import GenerationId

log = structlog.get_logger(__name__)


class StoreHost:
    """This daemon's TCP store for re-formed groups; ``endpoint`` is None if it could not start."""

    def __init__(self, addr: str, port: int = 0) -> None:
        self._addr = addr
        self._port = port
        self._store = None
        self.endpoint: str | None = None

    def start(self) -> StoreHost:
        import torch.distributed as dist

        try:
            self._store = dist.TCPStore(self._addr, self._port, is_master=True,
                                        wait_for_workers=False, timeout=timedelta(seconds=30))
        except (RuntimeError, OSError, ValueError) as exc:
            # Not fatal: without a store this node cannot be a re-formed group's rank 0,
            # so such a re-form takes the restart path.
            log.warning("could not host the recovery TCP store; in-place re-forms with this "
                        "node as rank 0 fall back to restarts", addr=self._addr, port=self._port,
                        reason=str(exc), fix="set [recovery] store_port to a free port, or 0")
            return self
        self.endpoint = f"{self._addr}:{self._store.port}"
        return self

    def prune(self, current: GenerationId) -> int:
        """Delete the keys of every generation older than ``current`` (the one just handed
        to the workers): their groups are left, nobody reads them again, and they told
        anyone who reaches the port every earlier group's layout. Returns how many went;
        a failure is logged, never raised (the keys only cost memory)."""
        if self._store is None:
            return 0
        try:
            old = [k for k in self._store.list_keys() if _older(k, current)]
            for key in old:
                self._store.delete_key(key)
        except (RuntimeError, OSError) as exc:
            log.warning("could not prune the recovery store's old generations", reason=str(exc))
            return 0
        return len(old)

    def stop(self) -> None:
        self._store = None   # the C++ store closes its listening socket when released
        self.endpoint = None


def _older(key: str, current: GenerationId) -> bool:
    """Whether ``key`` is under the prefix of a generation before ``current``
    (``GenerationId.store_prefix``: ``elasticd/<epoch>/<round>/<seq>/``); keys of no
    generation, and of ``current`` and later, stay."""
    parts = key.split("/", 4)
    if len(parts) < 5 or parts[0] != "elasticd" or not (parts[2].isdigit() and parts[3].isdigit()):
        return False
    epoch, round_, seq = parts[1], int(parts[2]), int(parts[3])
    if epoch != (current.epoch or "-"):
        return True       # another rendezvous lifetime: the job's earlier one
    return (round_, seq) < (current.round, current.seq)
