"""The TCP store each survivor hosts for its whole life, published as ``store``.

A re-formed group forms through the store of its new rank 0's host (its daemon, or its
companion under plain torchrun), so it never depends on a lost node's store (torchrun's
store lives in the rank-0 agent, and the etcd store in the agents' rendezvous).
"""

from __future__ import annotations

from datetime import timedelta

import structlog

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

    def stop(self) -> None:
        self._store = None   # the C++ store closes its listening socket when released
        self.endpoint = None
