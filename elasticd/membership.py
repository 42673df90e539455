"""Node membership: this node's record on a lease, and a watched view of the others.

``/elasticd/<job>/nodes/<node-id>`` holds a JSON record attached to the node's
lease. When a node dies or goes silent its key vanishes after the TTL, and every
other daemon sees the deletion through its watch. The view is re-listed only
when the watch broke (an etcd restart, a compaction): a healthy watch is never
re-created.

This node's record is what ``update`` last asked for: a write that fails (etcd
down, the cycle's deadline passed) leaves the record dirty, and ``poll``
republishes it until etcd has it, so peers never act on a stale state (a lost
``leaving`` would make a drained node look crashed).

Every record read is validated (``parse_record``): a value that is not a JSON
object of the expected types is treated as absent, with one warning naming the
key, so a malformed or hostile value can neither crash the loop nor the prober.

Thread model: the watch callback (the client's watch thread) applies events
under a lock; the daemon's main loop calls ``poll()`` and reads ``peers()`` and
``take_departed()``, so all decisions happen on one thread.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import structlog

from elasticd.contract.generation import Entering, GenerationRecordError, WorldView, is_endpoint
from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, KeyValue, WatchEvent
from elasticd.lease import LeaseKeeper
from elasticd.rendezvous.keys import JobKeys
from elasticd.supervisor import PeerView

log = structlog.get_logger(__name__)

_STATES = frozenset({"starting", "running", "backoff", "leaving", "completed", "failed"})


@dataclass(frozen=True)
class Peer:
    """A validated node record."""

    node_id: str
    record: dict[str, Any]
    mod_revision: int
    world: WorldView | None = None   # what its workers report of their world (validated)
    store: str | None = None         # HOST:PORT of its daemon's TCP store (validated)
    suspects: frozenset[str] = frozenset()  # the peers it suspects dead (elasticd.quorum)
    entering: Entering | None = None  # its newcomers wait to enter a live world (validated)

    @property
    def state(self) -> str:
        return self.record["state"]

    @property
    def probe(self) -> str | None:
        return self.record.get("probe")

    @property
    def agent(self) -> tuple[str, int] | None:
        pid = self.record.get("agent_pid")
        return (self.record.get("addr", ""), pid) if pid else None

    def view(self) -> PeerView:
        return PeerView(self.node_id, self.state, self.agent, self.mod_revision, self.probe,
                        world=self.world, store=self.store, suspects=self.suspects,
                        entering=self.entering)


def parse_record(node_id: str, value: bytes, mod_revision: int) -> Peer | None:
    """A ``Peer`` if ``value`` is a well-formed node record, else None (with the reason logged)."""
    try:
        record = json.loads(value)
    except (ValueError, TypeError):
        record, problem = None, "not JSON"
    else:
        problem = _record_problem(record)
    if problem is not None:
        log.warning("ignoring a malformed node record", key=f"nodes/{node_id}", problem=problem)
        return None
    record.setdefault("state", "starting")
    return Peer(node_id, record, mod_revision, _world(node_id, record), _store(node_id, record),
                _suspects(node_id, record), _entering(node_id, record))


def _suspects(node_id: str, record: dict[str, Any]) -> frozenset[str]:
    """The record's ``suspects``; a malformed list votes for nobody."""
    raw = record.get("suspects", [])
    if isinstance(raw, list) and len(raw) <= 4096 and all(isinstance(n, str) for n in raw):
        return frozenset(raw)
    log.warning("ignoring malformed suspects in a node record", key=f"nodes/{node_id}",
                problem="suspects is not a list of node ids")
    return frozenset()


def _world(node_id: str, record: dict[str, Any]) -> WorldView | None:
    """The record's ``world``; a malformed one leaves the peer's world unknown (restart path)."""
    raw = record.get("world")
    if raw is None:
        return None
    try:
        return WorldView.from_record(node_id, raw)
    except GenerationRecordError as exc:
        log.warning("ignoring a malformed world in a node record", key=f"nodes/{node_id}",
                    problem=str(exc))
        return None


def _entering(node_id: str, record: dict[str, Any]) -> Entering | None:
    """The record's ``entering``; a malformed one is no newcomer to take along."""
    raw = record.get("entering")
    if raw is None:
        return None
    try:
        return Entering.from_record(node_id, raw)
    except GenerationRecordError as exc:
        log.warning("ignoring a malformed entering field in a node record", key=f"nodes/{node_id}",
                    problem=str(exc))
        return None


def _store(node_id: str, record: dict[str, Any]) -> str | None:
    store = record.get("store")
    if store is None or (isinstance(store, str) and is_endpoint(store)):
        return store
    log.warning("ignoring a malformed store endpoint in a node record", key=f"nodes/{node_id}",
                problem=f"store {store!r} is not HOST:PORT")
    return None


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    state = record.get("state", "starting")
    if state not in _STATES:
        return f"state {state!r} is not one of {sorted(_STATES)}"
    pid = record.get("agent_pid")
    if pid is not None and (type(pid) is not int or pid <= 0):
        return f"agent_pid {pid!r} is not a positive whole number"
    for name in ("addr", "probe", "host"):
        if name in record and not isinstance(record[name], str):
            return f"{name} {record[name]!r} is not a string"
    probe = record.get("probe")
    if probe is not None and not is_endpoint(probe):
        return f"probe {probe!r} is not HOST:PORT"
    return None


class Membership:
    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, ttl_s: int,
                 record: dict[str, Any], clock=time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self.node_id = node_id
        self._record = dict(record, node_id=node_id)
        self._dirty = True
        # Our recent writes: an event with any other value on our key is someone else's.
        self._published: deque[bytes] = deque(maxlen=16)
        self._lease = LeaseKeeper(client, ttl_s, on_renewed=self._reattach, name="node")
        self._clock = clock
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}
        self._departed: list[Peer] = []
        self._needs_resync = True
        self._cancel_watch = None
        self._view_revision = 0   # events at or below it are already in the view
        self.etcd_ok = True
        self.resyncs = 0          # watch (re)creations: once, plus once per broken stream

    # -- this node ---------------------------------------------------------------------

    def register(self) -> None:
        """Grant the lease, publish the record, start watching the others."""
        self._lease.start()
        self._publish()
        self.resync()

    def update(self, **fields: Any) -> None:
        """Change fields of this node's record; a failed write is republished by ``poll``."""
        with self._lock:
            self._record.update(fields)
            self._dirty = True
        self._publish_best_effort()

    @property
    def record(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._record)

    @property
    def dirty(self) -> bool:
        """True while etcd may hold an older record than the last ``update``."""
        return self._dirty

    def _publish(self) -> None:
        with self._lock:
            self._record["updated"] = time.time()
            value = json.dumps(self._record).encode()
            self._dirty = True
        self._client.put(self._keys.node(self.node_id), value, lease=self._lease.id)
        with self._lock:
            self._published.append(value)
            if json.loads(value) == self._record:
                self._dirty = False

    def _publish_best_effort(self) -> None:
        try:
            self._publish()
        except EtcdError as exc:
            log.info("node record not written yet; republishing when etcd answers",
                     node=self.node_id, reason=str(exc))

    def _reattach(self, lease_id: int) -> None:
        log.warning("node lease was lost; re-registering", node=self.node_id, lease=lease_id)
        self._publish_best_effort()

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
        """Republish a dirty record; re-list and watch again if the watch broke."""
        if self._dirty:
            self._publish_best_effort()
        if self._needs_resync:
            self.resync()

    def resync(self) -> None:
        try:
            self._resync()
            self._set_etcd_ok(True)
        except EtcdError as exc:
            self._needs_resync = True
            self._set_etcd_ok(False, str(exc))

    def _resync(self) -> None:
        mine = self._client.get(self._keys.node(self.node_id))
        if mine is None or mine.lease_id != self._lease.id:
            self._publish()
        kvs, revision = self._client.list_prefix(self._keys.nodes)
        current = {p.node_id: p for p in map(self._peer, kvs) if p and p.node_id != self.node_id}
        if self._cancel_watch is not None:
            self._cancel_watch()
        with self._lock:
            for node_id in set(self._peers) - set(current):
                self._departed.append(self._peers[node_id])
            self._peers = current
            self._view_revision = revision
            self._needs_resync = False
        self._cancel_watch = self._client.watch_prefix(self._keys.nodes, self._on_watch,
                                                       start_revision=revision + 1)
        self.resyncs += 1

    def _on_watch(self, news: list[WatchEvent] | EtcdError) -> None:
        if isinstance(news, EtcdError):
            self._needs_resync = True
            return
        with self._lock:
            for event in news:
                self._apply(event)

    def _apply(self, event: WatchEvent) -> None:
        node_id = event.key.rsplit("/", 1)[-1]
        if event.mod_revision <= self._view_revision:
            return
        if node_id == self.node_id:
            if event.deleted or event.value not in self._published:
                self._dirty = True   # someone else wrote or deleted our record: restore it
            return
        if event.deleted:
            gone = self._peers.pop(node_id, None)
            if gone is not None:
                self._departed.append(gone)
            return
        peer = parse_record(node_id, event.value, event.mod_revision)
        if peer is not None:
            self._peers[node_id] = peer
        elif node_id in self._peers:
            # Garbage over a known peer's record: keep what we knew of it, but fence on the
            # key's new revision, or its crash could never be acted on (a fenced delete
            # against the old revision would fail for ever).
            self._peers[node_id] = replace(self._peers[node_id], mod_revision=event.mod_revision)

    def _peer(self, kv: KeyValue) -> Peer | None:
        return parse_record(kv.key.rsplit("/", 1)[-1], kv.value, kv.mod_revision)

    def _set_etcd_ok(self, ok: bool, reason: str = "") -> None:
        if ok == self.etcd_ok:
            return
        self.etcd_ok = ok
        if ok:
            log.info("etcd reachable again; membership view re-listed", node=self.node_id)
        else:
            log.warning("etcd unreachable; membership frozen, training continues",
                        node=self.node_id, reason=reason)
