"""A torch ``Store`` on etcd v3: the agents' key/value store during rendezvous.

Each key is one etcd key under the run's store prefix, attached to the run
lease. Blocking reads (``get``, ``wait``, ``multi_get``) read the keys, and if
some are missing, watch the first missing key from the revision they read at, so a
write that lands between the read and the watch is never missed, and a write of
another key wakes nobody.

Values are bytes; ``add`` keeps a decimal counter (as TCPStore does) updated
by compare-and-set, so concurrent adders never lose an increment.

The contract is torch's own, checked side by side with HashStore and TCPStore
(tests/rendezvous/test_store_contract.py), bare and through ``PrefixStore``:

- a blocking read that times out raises ``DistStoreError`` (also a
  ``TimeoutError``, which this store raised before); a 0 timeout is c10d's
  ``kNoTimeout``: wait for ever, as HashStore does;
- ``compare_set``, ``append``, ``multi_get``/``multi_set``, ``check``,
  ``delete_key`` and ``add`` (int64 arithmetic, values parsed as ``std::stoll``
  does, ``ValueError`` on a non-number) answer as torch's stores do;
- ``num_keys`` counts every key of this store, queues excepted, with no
  internal key (TCPStore counts one more, its own init key); it equals
  ``len(list_keys())``;
- torch 2.13's pybind trampoline calls ``getNumKeys`` and ``deleteKey`` (the
  C++ names) from a ``PrefixStore``: both are here. It does not forward
  ``listKeys`` nor the queue methods at all, so through a PrefixStore those are
  torch's ``NotImplementedError`` whatever a Python store defines;
- queues (``queue_push``/``queue_pop``/``queue_len``) are not implemented: the
  ``NotImplementedError`` torch's stores without queues raise;
- a ``PrefixStore`` holds only the C++ half of this object: keep a Python
  reference to the store (torch's rendezvous handler does), or its methods are
  gone ("Not implemented").
"""

from __future__ import annotations

import re
import time
from datetime import timedelta

import torch.distributed as dist

from elasticd.etcd_client import EtcdClient
from elasticd.lease import LeaseKeeper

DEFAULT_TIMEOUT = timedelta(seconds=300)

_INT64 = 1 << 64
# What std::stoll accepts (HashStore parses set values with it): leading white
# space, a sign, decimal digits; anything after the digits is ignored.
_STOLL = re.compile(rb"[ \t\n\v\f\r]*([+-]?[0-9]+)")


class StoreTimeoutError(dist.DistStoreError, TimeoutError):
    """A blocking read timed out: torch's ``DistStoreError`` (what torch's stores raise and
    its callers catch), and a ``TimeoutError`` (what this store raised before)."""


def _int64(value: int) -> int:
    """Two's-complement wrap, as ``int64_t`` arithmetic in torch's C++ stores."""
    value %= _INT64
    return value - _INT64 if value >= _INT64 >> 1 else value


def _stoll(value: bytes) -> int:
    if not value:
        return 0  # HashStore/FileStore count an empty value as 0
    match = _STOLL.match(value)
    if match is None:
        raise ValueError(f"stoll: value {value[:40]!r} is not a number")
    number = int(match.group(1))
    if not -(1 << 63) <= number < 1 << 63:
        raise ValueError(f"stoll: value {value[:40]!r} is out of int64 range")
    return number


class EtcdV3Store(dist.Store):
    def __init__(self, client: EtcdClient, prefix: str, lease: LeaseKeeper | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._lease = lease
        # Clones handed to C++ (a PrefixStore's clone) must keep their Python half.
        self._clones: list[EtcdV3Store] = []
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
        """Values of ``keys`` once all exist; ``StoreTimeoutError`` after ``timeout``
        (the store's when None; 0 is c10d's kNoTimeout: no limit)."""
        timeout_s = (self.timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        full = [self._key(k) for k in keys]
        while True:
            found, revision = self._client.get_many(full)
            if len(found) == len(full):
                return [found[k].value for k in full]
            remaining = 5.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k, f in zip(keys, full, strict=True) if f not in found]
                raise StoreTimeoutError(
                    f"etcd3 store: wait timeout after {timeout_s * 1000:.0f}ms, keys: "
                    f"{', '.join(missing)} (Timeout waiting for key under {self._prefix})"
                )
            # Woken by the first missing key alone: watching the whole prefix would wake
            # every waiting agent on every agent's write (torch's rank assignment has N
            # agents each waiting for its own key: O(N^2) wake-ups and re-reads).
            first_missing = next(f for f in full if f not in found)
            self._client.wait_for_change(first_missing, revision, min(remaining, 5.0),
                                         exact=True)

    def _update(self, key: str, change) -> bytes:
        """Write ``change(current value or None)`` by compare-and-set; return what was written."""
        full = self._key(key)
        while True:
            current = self._client.get(full)
            value = change(current.value if current else None)
            expected = current.mod_revision if current else None
            won, _ = self._client.put_or_create(full, value, expected, self._lease_id())
            if won:
                return value

    # -- torch's Store API ----------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), self._bytes(value), self._lease_id())

    def get(self, key: str) -> bytes:
        return self._read_blocking([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._read_blocking(list(keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        keys, values = list(keys), list(values)
        if len(keys) != len(values):  # TCPStore's refusal, before anything is written
            raise dist.DistStoreError("multiSet keys and values vectors must be of same size")
        for key, value in zip(keys, values, strict=True):
            self.set(key, value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._read_blocking(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        if not keys:
            return True
        found, _ = self._client.get_many([self._key(k) for k in keys])
        return len(found) == len(keys)

    def add(self, key: str, amount: int) -> int:
        written = self._update(
            key, lambda v: str(_int64((_stoll(v) if v is not None else 0) + amount)).encode())
        return int(written)

    def append(self, key: str, value: str | bytes) -> None:
        tail = self._bytes(value)
        self._update(key, lambda v: (v or b"") + tail)

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

    def list_keys(self) -> list[str]:
        return [kv.key[len(self._prefix):] for kv in self._client.get_prefix(self._prefix)]

    def has_extended_api(self) -> bool:
        return True  # append, multi_get, multi_set and compare_set are all native here

    def clone(self) -> EtcdV3Store:
        twin = EtcdV3Store(self._client, self._prefix, self._lease, self.timeout)
        self._clones.append(twin)
        return twin

    def queue_push(self, key: str, value: str | bytes) -> None:
        raise NotImplementedError("queue support is not implemented by the etcd3 store")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        raise NotImplementedError("queue support is not implemented by the etcd3 store")

    def queue_len(self, key: str) -> int:
        raise NotImplementedError("queue support is not implemented by the etcd3 store")

    # -- the names torch 2.13's pybind trampoline calls (from PrefixStore and C++) --------

    def getNumKeys(self) -> int:  # noqa: N802
        return self.num_keys()

    def deleteKey(self, key: str) -> bool:  # noqa: N802
        return self.delete_key(key)
