"""The job's lifecycle journal in etcd: ``/elasticd/<job>/events/<ts>-<node>``.

Best effort by design: a journal write never waits out an outage and never
raises, so an etcd outage cannot stall a decision. Entries live on a long lease,
so a dead job's journal expires by itself.

The lease is replaced, not kept alive: a lease older than half its TTL is swapped
for a new one before the next write (so every entry lives between TTL/2 and TTL
after it was written), and a write that finds its lease gone (expired, revoked,
etcd restored from an older snapshot) grants a new one and is tried once more.
Without this, every event after the first TTL was silently dropped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import structlog

from elasticd.errors import EtcdError, EtcdUnavailable
from elasticd.etcd_client import EtcdClient, no_retry
from elasticd.rendezvous.keys import JobKeys

log = structlog.get_logger(__name__)

JOURNAL_TTL_S = 7 * 24 * 3600


def _lease_gone(exc: EtcdError) -> bool:
    # etcd answers NOT_FOUND "etcdserver: requested lease not found"; the client adapter
    # keeps the server's words in the message.
    return not isinstance(exc, EtcdUnavailable) and "lease not found" in str(exc).lower()


class Journal:
    """Appends lifecycle events of one node to the job's journal."""

    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str,
                 ttl_s: int = JOURNAL_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self._node = node_id
        self._ttl_s = int(ttl_s)
        self._clock = clock
        self._lease: int | None = None
        self._granted_at = 0.0

    def record(self, kind: str, **fields: Any) -> None:
        """Write one entry; on any etcd error the entry is dropped (logged at debug)."""
        entry = {"kind": kind, "node": self._node, "time": time.time(), **fields}
        key = f"{self._keys.events}{time.time_ns():020d}-{self._node}"
        try:
            value = json.dumps(entry, default=str).encode()
        except ValueError as exc:  # a circular structure: drop the entry, not the caller
            log.debug("journal entry dropped; not serializable", kind=kind, reason=str(exc))
            return
        try:
            with no_retry():
                try:
                    self._client.put(key, value, lease=self._current_lease())
                except EtcdError as exc:
                    if not _lease_gone(exc):
                        raise
                    log.info("journal lease was gone; granted a new one", kind=kind)
                    self._lease = None
                    self._client.put(key, value, lease=self._current_lease())
        except EtcdError as exc:
            log.debug("journal entry dropped", kind=kind, reason=str(exc))

    def _current_lease(self) -> int:
        if self._lease is None or self._clock() - self._granted_at >= self._ttl_s / 2:
            self._lease = self._client.grant_lease(self._ttl_s)
            self._granted_at = self._clock()
        return self._lease


def recent_events(client: EtcdClient, keys: JobKeys, limit: int = 20,
                  warn: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The newest ``limit`` journal entries, oldest first (see ``recent_entries``)."""
    return [entry for _, entry in recent_entries(client, keys, limit, warn)]


def recent_entries(client: EtcdClient, keys: JobKeys, limit: int = 20,
                   warn: Callable[[str], None] | None = None) -> list[tuple[str, dict[str, Any]]]:
    """(key, entry) of the newest ``limit`` journal entries, oldest first.

    Anyone with write access to the prefix can put anything there: an entry that is not
    a JSON object is skipped (``warn`` hears its key), so readers only see dicts.
    """
    kvs = sorted(client.get_prefix(keys.events), key=lambda kv: kv.key)[-limit:]
    out = []
    for kv in kvs:
        try:
            entry = json.loads(kv.value)
        except ValueError:  # also covers bytes that are not UTF-8
            entry = None
        if isinstance(entry, dict):
            out.append((kv.key, entry))
        elif warn is not None:
            warn(f"{kv.key}: journal entry is not a JSON object; skipped")
    return out
