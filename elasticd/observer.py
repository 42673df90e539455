"""What the daemon's loop reads each cycle, validated: the progress file, the job's
etcd keys, the newest checkpoint, and the reaping of adopted orphans.

Reads only. Every value that comes from a file or from etcd is checked here and
a bad one is treated as absent with one warning naming the key (or file): a
malformed value, written by mistake or by an attacker with access to the job
prefix, can neither crash the loop nor steer it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import structlog

from elasticd.contract.generation import GenerationRecord, GenerationRecordError
from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, KeyValue
from elasticd.rendezvous import state_ops
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.rounds import CorruptRoundError, World, decode_pointer

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class JobView:
    """The job's keys in etcd, as last read."""

    job_state: str | None = None
    drain_reason: str | None = None   # set when `elasticd drain` asked for this node
    rdzv_closed: bool = False
    round: int | None = None
    # Keyed rounds: the agents (addr, pid) of that round's world (empty: unknown, or
    # torch's layout); read once per round, a world record never changes.
    round_members: frozenset[tuple[str, int]] = frozenset()
    generation: GenerationRecord | None = None   # the agreed in-place generation
    ok: bool = True                   # the last read succeeded


class JobReader:
    """Reads ``/state``, this node's drain key, the rendezvous state and the agreed
    generation every ``every_s``, and at the next ``read`` after one of them changed once
    ``watch`` is on.

    One atomic read (fail-fast, within the caller's deadline); on an etcd error the
    last view is kept with ``ok=False``.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, every_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._keys = keys
        self._drain_key = keys.drain(node_id)
        self._every_s = every_s
        self._clock = clock
        self._read_at = float("-inf")
        self._cancels: list[Callable[[], None]] = []
        self._rearm = False      # the watch is off after a broken stream: re-arm it at a read
        self._warned: set[tuple[str, int]] = set()
        self.view = JobView()
        self.round_trips: list[float] = []   # durations of successful reads, taken by the metrics

    @property
    def _keys_read(self) -> list[str]:
        return [self._keys.state, self._drain_key, self._keys.rdzv_state, self._keys.generation,
                self._keys.rdzv_round, self._keys.rdzv_closed]

    def watch(self) -> None:
        """Read again at the next ``read`` whenever a key it reads changes: a member learns a
        generation agreed by a joiner (or a drain request) within the caller's tick, not
        within ``every_s``. The period stays the fallback; a watch that cannot be set up or
        whose stream breaks is set up again at a later read."""
        self.unwatch()
        try:
            # A prefix watch: a key that merely starts like one of them wakes a read early.
            self._cancels = [self._client.watch_prefix(key, self._changed) for key in self._keys_read]
            self._rearm = False
        except EtcdError:
            self._rearm = True

    def unwatch(self) -> None:
        cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            cancel()

    def _changed(self, news: object) -> None:
        # On the client's watch thread: one assignment, read by ``read`` on the caller's.
        self._read_at = float("-inf")
        if isinstance(news, EtcdError):
            self._rearm = True

    def read(self) -> JobView:
        now = self._clock()
        if now - self._read_at < self._every_s:
            return self.view
        self._read_at = now   # before the get: a change seen during it wakes the next read
        try:
            found, _ = self._client.get_many(self._keys_read)
            self.round_trips.append(self._clock() - now)
        except EtcdError:
            self.view = dataclasses.replace(self.view, ok=False)
            return self.view
        if self._rearm:
            self.watch()
        round_, closed = self._round(found)
        members = self._members(round_, self._keys.rdzv_round in found)
        if members is None:
            self.view = dataclasses.replace(self.view, ok=False)
            return self.view
        self.view = JobView(
            job_state=self._field(found.get(self._keys.state), "state"),
            drain_reason=self._drain(found.get(self._drain_key)),
            rdzv_closed=closed, round=round_, round_members=members,
            generation=self._generation_record(found.get(self._keys.generation)))
        return self.view

    def _members(self, round_: int | None, keyed: bool) -> frozenset[tuple[str, int]] | None:
        """The agents of keyed round ``round_``'s world (the last view's if it is the same
        round); None on an etcd error."""
        if not keyed or round_ is None:
            return frozenset()
        if round_ == self.view.round and self.view.round_members:
            return self.view.round_members
        try:
            kv = self._client.get(self._keys.rdzv_world(round_))
        except EtcdError:
            return None
        if kv is None:
            return frozenset()
        try:
            world = World.decode(kv.value, kv.key)
        except CorruptRoundError as exc:
            self._warn(kv, str(exc))
            return frozenset()
        return frozenset((m.addr, m.pid) for m in world.members)

    def _generation_record(self, kv: KeyValue | None) -> GenerationRecord | None:
        if kv is None:
            return None
        try:
            return GenerationRecord.from_json(kv.value)
        except GenerationRecordError as exc:
            self._warn(kv, str(exc))
            return None

    def _object(self, kv: KeyValue | None) -> dict[str, Any] | None:
        if kv is None:
            return None
        try:
            value = json.loads(kv.value)
        except ValueError:
            value = None
        if isinstance(value, dict):
            return value
        self._warn(kv, "not a JSON object")
        return None

    def _field(self, kv: KeyValue | None, name: str) -> str | None:
        value = self._object(kv)
        if value is None:
            return None
        field = value.get(name)
        if isinstance(field, str):
            return field
        self._warn(kv, f"{name!r} is not a string")
        return None

    def _drain(self, kv: KeyValue | None) -> str | None:
        value = self._object(kv)
        if value is None:
            return None if kv is None else "`elasticd drain` asked for it"
        reason = value.get("reason", "")
        reason = reason if isinstance(reason, str) else ""
        return f"`elasticd drain` asked for it{': ' + reason[:200] if reason else ''}"

    def _round(self, found: dict[str, KeyValue]) -> tuple[int | None, bool]:
        """(round, closed) of either layout: keyed rounds' small pointer and ``closed``
        key when the pointer exists, else torch's state."""
        pointer = found.get(self._keys.rdzv_round)
        if pointer is not None:
            try:
                return decode_pointer(pointer.value, pointer.key)[0], self._keys.rdzv_closed in found
            except CorruptRoundError as exc:
                self._warn(pointer, str(exc))
                return None, self._keys.rdzv_closed in found
        kv = found.get(self._keys.rdzv_state)
        if kv is None:
            return None, False
        try:
            view = state_ops.view(kv.value)
        except Exception as exc:  # untrusted bytes: any failure means "unreadable"
            self._warn(kv, f"not a rendezvous state torch can read ({type(exc).__name__}: {exc})")
            return None, False
        return view.round, view.closed

    def _warn(self, kv: KeyValue, problem: str) -> None:
        if (kv.key, kv.mod_revision) in self._warned:
            return
        self._warned.add((kv.key, kv.mod_revision))
        log.warning("ignoring a malformed value in etcd; treating it as absent", key=kv.key,
                    problem=problem, fix="delete the key or write a valid value")


class CheckpointScanner:
    """Finds the newest committed checkpoint step in a thread, off the daemon's loop.

    The directory is usually shared (NFS): a stalled mount must stall this thread
    only, never the loop and its watchdog pings.
    """

    def __init__(self, directory: str, every_s: float = 2.0,
                 scan: Callable[[str], int | None] | None = None) -> None:
        self._directory = directory
        self._every_s = every_s
        self._scan = scan or newest_committed_step
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.step: int | None = None
        self._thread = threading.Thread(target=self._run, name="elasticd-ckpt-scan", daemon=True)

    def start(self) -> CheckpointScanner:
        self._thread.start()
        return self

    def poke(self) -> None:
        """Scan soon (a checkpoint or stop event was seen)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step = self._scan(self._directory)
            except Exception as exc:  # a scan error must not end the thread
                log.warning("checkpoint scan failed", dir=self._directory, reason=str(exc))
            self._wake.wait(self._every_s)
            self._wake.clear()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=2)


def newest_committed_step(directory: str) -> int | None:
    """The newest committed checkpoint's step (manifests only, no tensors), or None."""
    from checkpointing import CheckpointError, CheckpointManager
    from elasticd.contract.locations import is_url

    if not is_url(directory) and not os.path.isdir(directory):
        return None
    try:
        return CheckpointManager(directory, read_only=True).latest_step()
    except CheckpointError:
        return None


def reap_orphans(keep: int | None) -> list[int]:
    """Reap exited children other than ``keep`` (the agent, reaped by its Popen).

    As child subreaper the daemon adopts every orphaned descendant; unreaped, they
    stay zombies. ``waitpid(-1)`` would also reap the agent and lose its exit code.
    """
    reaped = []
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return reaped
    for child in children:
        if child.pid == keep:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                continue
            pid, _ = os.waitpid(child.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue
        if pid:
            reaped.append(pid)
    return reaped
