"""The job's lifecycle journal in etcd: ``/elasticd/<job>/events/<ts>-<node>``.

Best effort by design: a journal write never retries and never raises, so an
etcd outage cannot stall a decision. Entries live on a long lease, so a dead
job's journal expires by itself.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, no_retry
from elasticd.rendezvous.keys import JobKeys

log = structlog.get_logger(__name__)

JOURNAL_TTL_S = 7 * 24 * 3600


class Journal:
    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str) -> None:
        self._client = client
        self._keys = keys
        self._node = node_id
        self._lease: int | None = None

    def record(self, kind: str, **fields: Any) -> None:
        entry = {"kind": kind, "node": self._node, "time": time.time(), **fields}
        key = f"{self._keys.events}{time.time_ns():020d}-{self._node}"
        try:
            with no_retry():
                if self._lease is None:
                    self._lease = self._client.grant_lease(JOURNAL_TTL_S)
                self._client.put(key, json.dumps(entry).encode(), lease=self._lease)
        except EtcdError as exc:
            log.debug("journal entry dropped; etcd unreachable", kind=kind, reason=str(exc))


def recent_events(client: EtcdClient, keys: JobKeys, limit: int = 20) -> list[dict[str, Any]]:
    """The newest ``limit`` journal entries, oldest first."""
    kvs = sorted(client.get_prefix(keys.events), key=lambda kv: kv.key)[-limit:]
    out = []
    for kv in kvs:
        try:
            out.append(json.loads(kv.value))
        except ValueError:
            continue
    return out
