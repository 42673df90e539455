"""``RendezvousBackend`` for torch's dynamic rendezvous, on etcd v3.

The backend is only a compare-and-set register: the state is one etcd key, its
fencing token is the key's ``mod_revision``, and every write is one etcd
transaction (compare the revision, or create-if-absent when the token is None).
The rendezvous rules themselves stay in torch's ``DynamicRendezvousHandler``.

torch ``pickle.loads`` whatever the backend returns. Every value read from etcd is
therefore first loaded with the restricted unpickler (``state_ops.load_state``): a value
that is not a plain rendezvous state never reaches torch, and the agent gets torch's
``RendezvousStateError`` naming the key and the fix instead.
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient
from elasticd.lease import LeaseKeeper

# state_ops as a module: it imports torch, whose import loads this plugin (a cycle at start).
from elasticd.rendezvous import BACKEND_NAME, state_ops

Token = Any


class EtcdV3RendezvousBackend(RendezvousBackend):
    """State at ``key``, attached to ``lease`` so a dead run's state expires."""

    def __init__(self, client: EtcdClient, key: str, lease: LeaseKeeper | None = None) -> None:
        self._client = client
        self._key = key
        self._lease = lease
        self._seen: int | None = None   # mod_revision of the last state read or written

    def wait_for_change(self, timeout_s: float) -> None:
        """Return once the state changed after the last read or write, or after ``timeout_s``.

        What torch's one-second poll between rendezvous syncs becomes (handler.py): a
        joining node learns of the others' joins when they happen, not up to 1 s later.
        """
        if self._seen is None:
            time.sleep(timeout_s)
            return
        started = time.monotonic()
        try:
            self._client.wait_for_change(self._key, self._seen, timeout_s)
        except EtcdError:
            time.sleep(max(timeout_s - (time.monotonic() - started), 0.0))

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv = self._client.get(self._key)
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd3 rendezvous: reading state failed: {exc}") from exc
        if kv is None:
            return None
        self._seen = kv.mod_revision
        return self._checked(kv.value), kv.mod_revision

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
        if kv is not None:
            self._seen = kv.mod_revision
        if won:
            # The bytes torch itself just pickled: nothing from etcd to check.
            return state, kv.mod_revision, True
        return None if kv is None else (self._checked(kv.value), kv.mod_revision, False)

    def _checked(self, value: bytes) -> bytes:
        """``value`` unchanged once it loads as a plain rendezvous state (else CorruptStateError)."""
        state_ops.load_state(value, self._key)
        return value


def _as_revision(token: Token | None) -> int | None:
    if token is None:
        return None
    try:
        revision = int(token)
    except (TypeError, ValueError):
        return None
    return revision if revision > 0 else None
