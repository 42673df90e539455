"""A torch ``Store`` on etcd v3: the agents' key/value store during rendezvous.

Each key is one etcd key under the run's store prefix, attached to the run
lease. Blocking reads (``get``, ``wait``, ``multi_get``) read the keys, and if
some are missing, watch the prefix from the revision they read at, so a write
that lands between the read and the watch is never missed.

Values are bytes; ``add`` keeps a decimal counter (as TCPStore does) updated
by compare-and-set, so concurrent adders never lose an increment.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from elasticd.etcd_client import EtcdClient
from elasticd.lease import LeaseKeeper

DEFAULT_TIMEOUT = timedelta(seconds=300)


class EtcdV3Store(dist.Store):
    def __init__(self, client: EtcdClient, prefix: str, lease: LeaseKeeper | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._lease = lease
        self.set_timeout(timeout)

    # -- helpers --------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _lease_id(self) -> int | None:
        return self._lease.id if self._lease else None

    @staticmethod
    def _bytes(value: str | bytes | list[int]) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def _read_blocking(self, keys: list[str], timeout: timedelta | None = None) -> list[bytes]:
        """Values of ``keys`` once all exist, or ``LookupError``-free timeout error."""
        timeout_s = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + timeout_s
        full = [self._key(k) for k in keys]
        while True:
            found, revision = self._client.get_many(full)
            if len(found) == len(full):
                return [found[k].value for k in full]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, f in zip(keys, full, strict=True) if f not in found]
                # torch's agent code expects a timeout to surface as an exception
                # whose text says so (like TCPStore's "Timeout waiting for key").
                raise TimeoutError(
                    f"etcd3 store: timeout after {timeout_s:.1f} s waiting for keys {missing}"
                )
            self._client.wait_for_change(self._prefix, revision, min(remaining, 5.0))

    # -- the Store API used by torch's elastic agent -----------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), self._bytes(value), self._lease_id())

    def get(self, key: str) -> bytes:
        return self._read_blocking([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._read_blocking(list(keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._read_blocking(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        found, _ = self._client.get_many([self._key(k) for k in keys])
        return len(found) == len(keys)

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            current = self._client.get(full)
            value = int(current.value or b"0") + amount if current else amount
            expected = current.mod_revision if current else None
            won, _ = self._client.put_or_create(full, str(value).encode(), expected,
                                                self._lease_id())
            if won:
                return value

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        full = self._key(key)
        expected, desired = self._bytes(expected_value), self._bytes(desired_value)
        while True:
            current = self._client.get(full)
            if current is None and expected:
                return expected  # TCPStore's answer when the key is absent
            if current is not None and current.value != expected:
                return current.value
            revision = current.mod_revision if current else None
            won, _ = self._client.put_or_create(full, desired, revision, self._lease_id())
            if won:
                return desired

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        return len(self._client.get_prefix(self._prefix))

    def clone(self) -> EtcdV3Store:
        return EtcdV3Store(self._client, self._prefix, self._lease, self.timeout)

