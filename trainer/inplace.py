"""In-place recovery: the survivors of a lost peer re-form the group without restarting.

The daemons agree on the next generation in etcd (``elasticd.contract.generation``) and each
hands it to its workers in the local generation file. A worker whose collective fails,
or who is released from one by that file, then (all bounded by ``recovery_bound_s``):

1. waits for a generation newer than its own that names its node (else: fenced out);
2. abandons its group: aborts it (so survivors blocked on *it* are released too) and
   drops it from torch's registry, keeping the objects alive (destroying a gloo group
   whose thread is stuck on a frozen peer would join that thread forever);
3. joins the new group through the store the record names (hosted by a survivor's
   daemon, under the generation's own prefix);
4. agrees on the newest completed step; if the survivors differ (one finished its
   optimizer step while another's all-reduce failed), the lowest rank holding the
   newest state sends it whole (model, optimizer, sampler, LR scale) to the others.

The caller (``trainer.loop``) then rescales the LR to the new world, rebuilds DDP and
redoes the step in flight. Anything that fails or outlasts the bound raises
``ReformError``: the worker exits and torchrun's restart path recovers.

Every wait on a collective goes through ``CollectiveGuard``: in slices, checking between
them whether the daemon has named a newer generation. That is what releases a worker
blocked on a *silent* peer as soon as the daemon evicted it: on gloo an abort from
another thread does not release a blocked collective, a bounded ``work.wait`` does.
On NCCL the guard polls ``is_completed()`` and the release aborts the communicator.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist

from elasticd.contract.generation import GenerationId, GenerationRecord, GenerationRecordError, read_file
from elasticd.contract.secret import proof
from trainer.errors import TrainerError

log = structlog.get_logger(__name__)

# How often a blocked collective looks at the generation file: the release latency.
SLICE_S = 0.02
# How often a worker that lost its group looks for the daemon's next generation.
POLL_S = 0.01


class ReformError(TrainerError):
    """The in-place re-form failed or outlasted its bound: exit for a torchrun restart."""


class Superseded(ReformError):
    """A newer generation was agreed while this worker waited to form ``record``'s group
    (a second loss during the re-form: a silent member's lease expired only now)."""

    def __init__(self, record: GenerationRecord) -> None:
        super().__init__(f"generation {record.id} superseded the one being joined")
        self.record = record


class MembershipChange(Exception):  # noqa: N818 - an event the loop is left by, not an error
    """Every rank agreed, after the same step, to take ``record``: a planned change (a
    join, a drain) the daemons agreed. Raised out of the loop at that step boundary; the
    re-form (trainer.recover) takes the group into it with no collective failed."""

    def __init__(self, record: GenerationRecord) -> None:
        super().__init__(f"generation {record.id} ({record.cause or 'planned'}) agreed")
        self.record = record


class Released(Exception):
    """The daemon named a newer generation while this worker waited on its old group."""


class GenerationWatch:
    """The daemon's generation file, parsed again only when it changes on disk."""

    def __init__(self, path: str, mine: GenerationId) -> None:
        self.path = path
        self.mine = mine
        self._seen: tuple[int, int, int] | None = None
        self._record: GenerationRecord | None = None

    def newer(self) -> GenerationRecord | None:
        """A record of this round newer than ``mine``, or None."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._seen:
            self._seen = stamp
            try:
                self._record = read_file(self.path)
            except (OSError, GenerationRecordError) as exc:
                log.warning("generation file unreadable; ignoring it", path=self.path,
                            error=str(exc))
                self._record = None
        record = self._record
        return record if record is not None and record.id.newer_than(self.mine) else None

    def wait(self, deadline: float, clock: Callable[[], float] = time.monotonic,
             accept: Callable[[GenerationRecord], bool] = lambda _: True,
             wanted: str = "") -> GenerationRecord:
        """The first newer record that ``accept`` takes (``wanted``: what, for the error)."""
        while (record := self.newer()) is None or not accept(record):
            if clock() >= deadline:
                raise ReformError(f"no generation newer than {self.mine}{wanted} in {self.path} "
                                  "within the bound (the daemons did not agree on one)")
            time.sleep(POLL_S)
        return record


class CollectiveGuard:
    """Waits on collectives in slices; releases every waiter once ``released()`` says why.

    The main thread waits through ``wait``; DDP's gradient buckets through ``comm_hook``,
    whose futures the guard's thread completes or fails (the reducer blocks on them).
    """

    def __init__(self, released: Callable[[], str | None], backend: str,
                 timeout_s: float) -> None:
        self.released = released
        self.backend = backend
        self.timeout_s = timeout_s
        self.why: str | None = None
        self._tracked: list[Any] = []  # every collective started through this guard
        self._queue: collections.deque[tuple[Any, torch.futures.Future, torch.Tensor]] = (
            collections.deque())
        self._wake = threading.Condition()
        self._closed = False
        threading.Thread(target=self._serve, name="collective-guard", daemon=True).start()

    def wait(self, work: Any, what: str) -> None:
        """Block until ``work`` completes; raise ``Released`` or the collective's error."""
        self.track(work)
        started = time.monotonic()
        while not self._done(work, started, what):
            self._check_released()

    def comm_hook(self, state, bucket):  # noqa: ANN001, ANN201 - DDP checks real annotations
        """A DDP comm hook: the averaged all-reduce of the default one, through the guard.

        (Unannotated: DDP rejects a hook whose annotations are strings, as they are here.)
        """
        buf = bucket.buffer().div_(dist.get_world_size())
        fut: torch.futures.Future = torch.futures.Future(
            devices=[buf.device] if buf.is_cuda else None)
        if self.why is not None:
            fut.set_exception(Released(self.why))
            return fut
        work = dist.all_reduce(buf, async_op=True)
        self.track(work)
        with self._wake:
            self._queue.append((work, fut, buf))
            self._wake.notify()
        return fut

    def track(self, work: Any) -> None:
        """Count ``work`` among this group's collectives (``unfinished`` reads them); an
        asynchronous one nobody waits on yet (the stop agreement in flight) too."""
        with self._wake:
            self._tracked = [w for w in self._tracked if not w.is_completed()]
            self._tracked.append(work)

    def unfinished(self) -> int:
        """How many collectives started through this guard have not finished (completed
        or failed): on gloo each holds one of the group's worker threads. After a peer's
        crash some can be stuck on a *live* survivor, which abandoned its side of them
        when its own collective failed, as surely as after a release from a frozen peer."""
        with self._wake:
            self._tracked = [w for w in self._tracked if not w.is_completed()]
            return len(self._tracked)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if self._closed:
                    self._fail_pending(Released(self.why or "the group was abandoned"))
                    return
                work, fut, buf = self._queue.popleft()
            try:
                self.wait(work, "gradient all-reduce")
                fut.set_result(buf)
            except Exception as exc:  # noqa: BLE001 - handed to the reducer, which raises it
                fut.set_exception(exc)

    def _fail_pending(self, exc: Exception) -> None:
        while self._queue:
            self._queue.popleft()[1].set_exception(exc)

    def _check_released(self) -> None:
        if self.why is None:
            self.why = self.released()
        if self.why is not None:
            raise Released(self.why)

    def _done(self, work: Any, started: float, what: str) -> bool:
        if time.monotonic() - started > self.timeout_s:
            raise RuntimeError(f"{what} timed out after {self.timeout_s:.0f} s "
                               "(the process group's timeout)")
        if self.backend == "gloo":
            try:
                return bool(work.wait(timeout=timedelta(seconds=SLICE_S)))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower():
                    return False
                raise
        if work.is_completed():
            work.wait()  # raises the collective's error, if any
            return True
        time.sleep(SLICE_S / 20)
        return False


def is_nccl(backend: str) -> bool:
    """Every name torch gives an NCCL backend (``nccl``, ``nccl2``, ``nccl-legacy``, ...)."""
    return str(backend).lower().startswith("nccl")


def bounded(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """``fn()`` in a thread, given up after ``seconds`` (ReformError); its error re-raised.

    A call given up on keeps running in its daemon thread: the worker exits soon after.
    """
    result: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            error.append(exc)

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    if thread.is_alive():
        raise ReformError(f"{what} did not finish within {seconds:.2f} s")
    if error:
        raise ReformError(f"{what} failed: {error[0]}") from error[0]
    return result[0] if result else None


def abandon_group(retain: list[object], backend: str, seconds: float) -> None:
    """Abort the default group and drop it from torch's registry, keeping it alive."""
    if not dist.is_initialized():
        return
    pg = dist.group.WORLD
    retain.append(pg)
    device = torch.device("cuda" if is_nccl(backend) else "cpu")

    def abort() -> None:
        with contextlib.suppress(RuntimeError, AttributeError, NotImplementedError):
            pg._get_backend(device).abort()

    bounded(abort, seconds, "aborting the old process group")
    bounded(dist.destroy_process_group, seconds, "leaving the old process group")


# The key every member adds 1 to in a generation's store before the group forms.
ARRIVED_KEY = "elasticd.arrived"


def store_client(record: GenerationRecord, seconds: float) -> Any:
    """A client of the store ``record`` names (the whole store, no prefix)."""
    if record.store is None:
        raise ReformError(f"generation {record.id} names no store to form through")
    host, _, port = record.store.rpartition(":")
    return bounded(lambda: dist.TCPStore(host, int(port), is_master=False,
                                         timeout=timedelta(seconds=max(seconds, 0.1))),
                   seconds, f"connecting to generation {record.id}'s store at {record.store}")


def generation_store(record: GenerationRecord, seconds: float) -> Any:
    """A client of the store ``record`` names, under the generation's own prefix."""
    return dist.PrefixStore(record.store_prefix, store_client(record, seconds))


def join_group(record: GenerationRecord, rank: int, backend: str, device: torch.device,
               timeout: timedelta, seconds: float,
               newer: Callable[[], GenerationRecord | None] = lambda: None) -> None:
    """Form ``record``'s group as ``rank`` through its store; bounded by ``seconds``.

    ``newer()``: a generation that supersedes ``record`` (``Superseded`` is raised if one
    appears before every member has arrived)."""
    deadline = time.monotonic() + seconds
    prefixed = generation_store(record, seconds)
    await_members(prefixed, record.world_size, f"generation {record.id}", deadline, newer)

    def init() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, store=prefixed, rank=rank,
                                world_size=record.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)

    bounded(init, deadline - time.monotonic(), f"joining generation {record.id} at {record.store}")


def await_members(store: Any, world_size: int, what: str, deadline: float,
                  newer: Callable[[], GenerationRecord | None]) -> None:
    """Count this member as arrived in ``store`` and wait until all ``world_size`` have,
    or a newer record supersedes the one being formed (``Superseded``). The wait is here,
    in Python, because gloo's rendezvous inside ``init_process_group`` (and inside a
    reconfigure) cannot be cut short: a member that never comes (frozen, its loss not yet
    decided when the record was agreed) held the others there until the bound, and the
    re-form fell back to a restart (seen in the goodput run: a crash 1.4 s after another
    node went silent, 8.3 s and 14 steps lost)."""
    store.add(ARRIVED_KEY, 1)
    while (arrived := store.add(ARRIVED_KEY, 0)) < world_size:
        if (later := newer()) is not None:
            raise Superseded(later)
        if time.monotonic() >= deadline:
            raise ReformError(f"{arrived} of the {world_size} members of {what} arrived "
                              "within the bound")
        time.sleep(POLL_S)


def vouch(record: GenerationRecord, secret: bytes | None, device: torch.device) -> None:
    """Every member of the group just formed proves it knows the job's secret
    (``elasticd.contract.secret``), before any state moves; ``ReformError`` names the ranks
    that did not (the restart path). Nothing to prove without a secret."""
    if secret is None:
        return
    world, gen = dist.get_world_size(), str(record.id)
    expected = [proof(secret, gen, record.store, r, record.node_at(r)) for r in range(world)]
    mine = torch.tensor(list(expected[dist.get_rank()]), dtype=torch.uint8, device=device)
    shown = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(shown, mine)
    wrong = [r for r, got in enumerate(shown) if bytes(got.cpu().tolist()) != expected[r]]
    if wrong:
        raise ReformError(f"rank(s) {wrong} of generation {record.id} did not prove the job's "
                          "secret: not this job's workers (or another secret file); the group "
                          "is not used")


def newest_state(step: int, device: torch.device,
                 stateless: Collection[int] = ()) -> tuple[int, int, list[int]]:
    """(newest step, lowest rank holding it, every rank's step) over the new group.

    ``stateless``: ranks whose claim is not taken (the record's joined members: every
    member masks them alike, so a newcomer, or a process posing as one, that claims a
    newer step than the members' is sent the state instead of sending its own)."""
    steps = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    steps[dist.get_rank()] = step
    dist.all_reduce(steps)
    every = [-1 if r in stateless else int(s) for r, s in enumerate(steps.tolist())]
    newest = max(every)
    return newest, every.index(newest), every

