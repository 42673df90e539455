"""Node membership: this node's record on a lease, and a watched view of the others.

``/elasticd/<job>/nodes/<node-id>`` holds a JSON record attached to the node's
lease. When a node dies or goes silent its key vanishes after the TTL, and every
other daemon sees the deletion through its watch. The view is also re-listed
periodically and after any watch error, so a broken stream (an etcd restart)
never leaves a daemon blind.

Thread model: the watch callback only sets a flag and records deletions; the
daemon's main loop calls ``poll()`` to apply them, so all decisions happen on
one thread.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, no_retry
from elasticd.lease import LeaseKeeper
from elasticd.rendezvous.keys import JobKeys

log = structlog.get_logger(__name__)

RESYNC_EVERY_S = 5.0


@dataclass(frozen=True)
class Peer:
    node_id: str
    record: dict[str, Any]
    mod_revision: int

    @property
    def state(self) -> str:
        return str(self.record.get("state", "unknown"))

    @property
    def agent(self) -> tuple[str, int] | None:
        pid = self.record.get("agent_pid")
        return (self.record.get("addr", ""), int(pid)) if pid else None


class Membership:
    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, ttl_s: int,
                 record: dict[str, Any], clock=time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self.node_id = node_id
        self._record = dict(record, node_id=node_id)
        self._lease = LeaseKeeper(client, ttl_s, on_renewed=self._reattach, name="node")
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._departed: list[Peer] = []
        self._needs_resync = True
        self._last_resync = float("-inf")
        self._cancel_watch = None
        self._view_revision = 0   # events at or below it are already in the view
        self.etcd_ok = True

    # -- this node ---------------------------------------------------------------------

    def register(self) -> None:
        """Grant the lease, publish the record, start watching the others."""
        self._lease.start()
        self._put_record()
        self.resync()

    def update(self, **fields: Any) -> None:
        """Change fields of this node's record; a failed write is retried by ``poll``."""
        self._record.update(fields)
        try:
            with no_retry():
                self._put_record()
        except EtcdError:
            self._needs_resync = True  # republished by the next successful resync

    @property
    def record(self) -> dict[str, Any]:
        return dict(self._record)

    def _put_record(self) -> None:
        self._record["updated"] = time.time()
        self._client.put(self._keys.node(self.node_id), json.dumps(self._record).encode(),
                         lease=self._lease.id)

    def _reattach(self, lease_id: int) -> None:
        log.warning("node lease was lost; re-registering", node=self.node_id, lease=lease_id)
        self._put_record()

    def leave(self) -> None:
        """Delete this node's record and revoke its lease (clean departure)."""
        if self._cancel_watch is not None:
            self._cancel_watch()
        try:
            self._client.delete(self._keys.node(self.node_id))
        except EtcdError as exc:
            log.warning("could not delete node record; it expires with the lease", reason=str(exc))
        self._lease.stop(revoke=True)

    # -- the others ----------------------------------------------------------------------

    def peers(self) -> dict[str, Peer]:
        with self._lock:
            return dict(self._peers)

    def take_departed(self) -> list[Peer]:
        """Peers whose key vanished since the last call (with their last record)."""
        with self._lock:
            departed, self._departed = self._departed, []
        return departed

    def poll(self) -> None:
        """Apply watch news; re-list when the watch broke or periodically."""
        due = self._clock() - self._last_resync >= RESYNC_EVERY_S
        if self._needs_resync or due:
            self.resync()

    def resync(self) -> None:
        try:
            with no_retry():
                self._resync()
            self._set_etcd_ok(True)
        except EtcdError as exc:
            self._needs_resync = True
            self._set_etcd_ok(False, str(exc))

    def _resync(self) -> None:
        mine = self._client.get(self._keys.node(self.node_id))
        if mine is None or mine.lease_id != self._lease.id:
            self._put_record()
        kvs, revision = self._client.list_prefix(self._keys.nodes)
        current = {p.node_id: p for p in map(self._peer, kvs) if p and p.node_id != self.node_id}
        with self._lock:
            for node_id in set(self._peers) - set(current):
                self._departed.append(self._peers[node_id])
            self._peers = current
            self._view_revision = revision
        self._restart_watch(revision)
        self._needs_resync = False
        self._last_resync = self._clock()

    def _restart_watch(self, revision: int) -> None:
        if self._cancel_watch is not None:
            self._cancel_watch()
        self._cancel_watch = self._client.watch_prefix(self._keys.nodes, self._on_watch,
                                                       start_revision=revision + 1)

    def _on_watch(self, response: Any) -> None:
        if isinstance(response, Exception):
            self._needs_resync = True
            return
        with self._lock:
            for event in response.events:
                self._apply(event)

    def _apply(self, event: Any) -> None:
        node_id = event.key.decode().rsplit("/", 1)[-1]
        if node_id == self.node_id or event.mod_revision <= self._view_revision:
            return
        if type(event).__name__ == "DeleteEvent":
            gone = self._peers.pop(node_id, None)
            if gone is not None:
                self._departed.append(gone)
            return
        peer = _parse(node_id, event.value, event.mod_revision)
        if peer is not None:
            self._peers[node_id] = peer

    def _peer(self, kv: Any) -> Peer | None:
        return _parse(kv.key.rsplit("/", 1)[-1], kv.value, kv.mod_revision)

    def delete_peer(self, peer: Peer) -> bool:
        """Fenced delete of a dead peer's record, so every daemon sees one event."""
        try:
            return self._client.delete_if_revision(self._keys.node(peer.node_id), peer.mod_revision)
        except EtcdError:
            return False

    def _set_etcd_ok(self, ok: bool, reason: str = "") -> None:
        if ok == self.etcd_ok:
            return
        self.etcd_ok = ok
        if ok:
            log.info("etcd reachable again; membership view re-listed", node=self.node_id)
        else:
            log.warning("etcd unreachable; membership frozen, training continues",
                        node=self.node_id, reason=reason)


def _parse(node_id: str, value: bytes, mod_revision: int) -> Peer | None:
    try:
        record = json.loads(value)
    except (ValueError, TypeError):
        log.warning("ignoring a node record that is not JSON", node=node_id)
        return None
    return Peer(node_id, record, mod_revision)
