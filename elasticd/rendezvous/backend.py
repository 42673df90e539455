"""``RendezvousBackend`` for torch's dynamic rendezvous, on etcd v3.

The backend is only a compare-and-set register: the state is one etcd key, its
fencing token is the key's ``mod_revision``, and every write is one etcd
transaction (compare the revision, or create-if-absent when the token is None).
The rendezvous rules themselves stay in torch's ``DynamicRendezvousHandler``.

The backend keeps torch's contract: the state is opaque bytes, returned as they were
stored (torch's own ``RendezvousBackendTestMixin`` holds for it). torch's state holder
``pickle.loads`` whatever its backend returns, and anyone who can write the job's prefix
can write this key, so this plugin's handler never gives torch the raw backend: it gives
it ``CheckedBackend``, which returns a value only once the restricted unpickler loaded it
as a plain rendezvous state (``state_ops.load_state``); anything else raises torch's
``RendezvousStateError`` naming the key and the fix, and never reaches ``pickle.loads``.
(Before, the check was in the backend itself: 8 of torch's backend tests failed, whose
states are bytes such as ``b"x"``.)
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
        return kv.value, kv.mod_revision

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
            return state, kv.mod_revision, True
        return None if kv is None else (kv.value, kv.mod_revision, False)

    @property
    def key(self) -> str:
        return self._key


class CheckedBackend(RendezvousBackend):
    """What torch's state holder reads through in this plugin's handler: ``backend``'s
    values, each only once it loads as a plain rendezvous state (``CorruptStateError``,
    torch's ``RendezvousStateError``, otherwise). A value this agent's own write just
    stored is torch's own pickle: nothing from etcd to check."""

    def __init__(self, backend: EtcdV3RendezvousBackend) -> None:
        self.raw = backend

    @property
    def name(self) -> str:
        return self.raw.name

    def wait_for_change(self, timeout_s: float) -> None:
        self.raw.wait_for_change(timeout_s)

    def get_state(self) -> tuple[bytes, Token] | None:
        got = self.raw.get_state()
        return None if got is None else (self._checked(got[0]), got[1])

    def set_state(self, state: bytes, token: Token | None = None
                  ) -> tuple[bytes, Token, bool] | None:
        got = self.raw.set_state(state, token)
        if got is None or got[2]:
            return got
        return self._checked(got[0]), got[1], False

    def _checked(self, value: bytes) -> bytes:
        state_ops.load_state(value, self.raw.key)
        return value


def _as_revision(token: Token | None) -> int | None:
    if token is None:
        return None
    try:
        revision = int(token)
    except (TypeError, ValueError):
        return None
    return revision if revision > 0 else None
