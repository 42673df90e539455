"""``RendezvousBackend`` for torch's dynamic rendezvous, on etcd v3.

The backend is only a compare-and-set register: the state is one etcd key, its
fencing token is the key's ``mod_revision``, and every write is one etcd
transaction (compare the revision, or create-if-absent when the token is None).
The rendezvous rules themselves stay in torch's ``DynamicRendezvousHandler``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient
from elasticd.lease import LeaseKeeper
from elasticd.rendezvous import BACKEND_NAME

Token = Any


class EtcdV3RendezvousBackend(RendezvousBackend):
    """State at ``key``, attached to ``lease`` so a dead run's state expires."""

    def __init__(self, client: EtcdClient, key: str, lease: LeaseKeeper | None = None) -> None:
        self._client = client
        self._key = key
        self._lease = lease

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._client.get(self._key)
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd3 rendezvous: reading state failed: {exc}") from exc
        return None if kv is None else (kv.value, kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        expected = _as_revision(token)
        if token is not None and expected is None:
            # A token we never issued cannot match: report the current state.
            current = self.get_state()
            return None if current is None else (*current, False)
        lease = self._lease.id if self._lease else None
        try:
            won, kv = self._client.put_or_create(self._key, state, expected, lease)
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd3 rendezvous: writing state failed: {exc}") from exc
        if won:
            return state, kv.mod_revision, True
        return None if kv is None else (kv.value, kv.mod_revision, False)


def _as_revision(token: Token | None) -> int | None:
    if token is None:
        return None
    try:
        revision = int(token)
    except (TypeError, ValueError):
        return None
    return revision if revision > 0 else None
