"""In-place recovery for plain torchrun (``--rdzv-conf recovery=in-place``, no daemon).

Under the daemon, a lost peer is detected, the next generation agreed and handed to the
workers by the daemon (``supervisor.py``, ``daemon.py``), by the in-place protocol
of ``elasticd.inplace``. With plain torchrun the
agent is alone, so this companion, started by the plugin's handler inside the agent
process, does the daemon's part of that contract for its own workers:

* it hosts an ``inplace.store.StoreHost`` (a re-formed group with this node as rank 0 forms
  through it) and a ``probe.ProbeServer`` for the agent's life;
* after each completed round it publishes ``rdzv/recovery/<round>/<agent>`` (probe,
  store, the workers' world from their progress file, ``done`` once they completed)
  on its own lease (TTL ``keep_alive_interval`` x ``keep_alive_max_attempt``), and sets
  the workers' environment before torchrun starts them: ``ELASTICD_RECOVERY_MODE=
  in-place``, ``ELASTICD_GENERATION_FILE`` (a per-agent temporary directory, removed at
  shutdown), ``ELASTICD_NODE_ID`` (the agent's name in the round) and, unless set,
  ``ELASTICD_PROGRESS_FILE``; ``ELASTICD_GENERATION`` is the handler's
  (``export_generation``);
* a thread probes the round's other members (``probe.ring_successors`` of those with a
  record, every member a peer suspects, and every member whose record vanished) and
  judges them by the in-place protocol's one rule (``elasticd.inplace.loss``, the
  daemon's too): its own suspicions are published in its record (``suspects``), a
  member whose record lives is lost only when a strict majority of the round's live
  members suspect it (its record is then deleted, so every survivor sees it at once),
  never by a companion cut off from the majority; a member whose record vanished is
  confirmed by a probe (refused: crashed; unanswered: silent; answered: it moved on to
  another round, torchrun's restart). Each tick is the daemon's cycle in small: one
  snapshot (``_observe``), a pure decision (``judge`` the verdicts, ``plan`` the actions
  in the loops' vocabulary, ``elasticd.actions``: PUBLISH, EVICT, SHRINK,
  WRITE_GENERATION), one table of executors (``_ACTIONS``);
* a loss is agreed with ``inplace.agreement.shrink_world`` (one compare-and-set on the
  job's ``generation`` key, shared with the daemons' contract), handed to the workers
  (``inplace.handover``: they re-form), and the old round's exit barrier is released
  (``admin.release_exit_barrier``) by the companion whose write made the record; a
  record of our round agreed by another survivor is handed over too (the backstop).

Joins stay torchrun's restart path (``num_nodes_waiting``). Every etcd call is bounded
(``no_retry`` and a deadline); anything that fails leaves the workers to their own
bound (``recovery_bound_s``), after which they exit and torchrun restarts them. Every
thread is a daemon thread: none keeps the agent from exiting.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import structlog

from elasticd import quorum
from elasticd.actions import Action, Kind, act
from elasticd.contract.generation import (
    GenerationId,
    GenerationRecord,
    GenerationRecordError,
    WorldView,
    is_endpoint,
)
from elasticd.contract.progress import FINISHED, ProgressReader
from elasticd.contract.settings import IN_PLACE, RESTART
from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, deadline, no_retry
from elasticd.inplace import loss
from elasticd.inplace.agreement import shrink_world
from elasticd.inplace.handover import hand_over
from elasticd.inplace.loss import Loss
from elasticd.inplace.store import StoreHost
from elasticd.inplace.vetting import Roster, refusal
from elasticd.lease import LeaseKeeper
from elasticd.probe import Liveness, ProbeServer, probe, ring_successors
from elasticd.rendezvous import admin
from elasticd.rendezvous.keys import JobKeys

log = structlog.get_logger(__name__)

# Probes of the round's peers, and the timeout of each.
PROBE_INTERVAL_S = 0.2
PROBE_TIMEOUT_S = 0.3
# The round's records are re-listed this often (and at once after a refused probe).
LIST_INTERVAL_S = 1.0
# Every etcd step of a recovery, and each bookkeeping call, ends by then.
ETCD_DEADLINE_S = 1.0
SHRINK_BUDGET_S = 1.0
NEIGHBOURS = 2
# The per-agent directory in the temporary directory: <prefix><pid>-<random>.
DIR_PREFIX = "elasticd-agent-"


# -- the record and the pure decisions -----------------------------------------------------

@dataclass(frozen=True)
class PeerRecord:
    """One agent's companion in one round: ``rdzv/recovery/<round>/<node>``."""

    node: str
    probe: str
    store: str | None = None
    world: WorldView | None = None
    done: bool = False            # its workers completed: its departure is no loss
    suspects: frozenset[str] = frozenset()   # the members it suspects (``quorum``'s votes)

    def encode(self) -> bytes:
        return json.dumps({"probe": self.probe, "store": self.store, "done": self.done,
                           "world": None if self.world is None else self.world.to_record(),
                           "suspects": sorted(self.suspects)}, sort_keys=True).encode()

    @classmethod
    def decode(cls, node: str, raw: bytes | str) -> PeerRecord | None:
        """The record, or None (logged) when it is not one this module wrote."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or not is_endpoint(data.get("probe")):
                raise ValueError("probe must be HOST:PORT")
            store = data.get("store")
            if store is not None and not is_endpoint(store):
                raise ValueError("store must be HOST:PORT or null")
            done = data.get("done", False)
            if not isinstance(done, bool):
                raise ValueError("done must be a boolean")
            world = data.get("world")
            view = None if world is None else WorldView.from_record(node, world)
            suspects = data.get("suspects", [])
            if not isinstance(suspects, list) or not all(isinstance(n, str) for n in suspects):
                raise ValueError("suspects must be a list of node names")
        except (ValueError, TypeError, GenerationRecordError) as exc:
            log.warning("ignoring a malformed recovery record", node=node, problem=str(exc))
            return None
        return cls(node, data["probe"], store, view, done, frozenset(suspects))


@dataclass(frozen=True)
class Judgement:
    """What one round's companion remembers between its ticks (``judge``)."""

    suspicions: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    silent_since: Mapping[str, float] = field(default_factory=dict)
    isolated: bool = False
    condemned: frozenset[str] = frozenset()   # the majority's verdicts (records to delete)
    loss: Loss | None = None


def judge(me: str, known: Mapping[str, PeerRecord], present: Iterable[str],
          answers: Mapping[str, Liveness], world: Iterable[str] | None, finished: bool,
          prior: Judgement, now: float, silent_suspect_s: float) -> Judgement:
    """One tick's verdicts by ``inplace.loss``'s rule.

    ``known``: every member's last record seen this round; ``present``: those whose
    record exists now; ``answers``: the last probe of each; ``world``: the nodes of our
    workers' current generation (None: unknown yet, every known member counts). A
    member whose workers completed, and every member once our own workers finished, is
    never lost.
    """
    present = set(present)
    peers = {n: known[n] for n in present if n in known and n != me and not known[n].done}
    said = {n: a.value for n, a in answers.items()}
    mine, silent = loss.suspicions(said, peers, prior.suspicions, prior.silent_since, now,
                                   silent_suspect_s)
    condemned = quorum.condemned(me, set(mine), peers)
    verdicts = {n: mine.get(n, (loss.SILENT, now))[0] for n in condemned}
    for node in set(known) - present - {me}:
        if not known[node].done:
            how = loss.departed(False, said.get(node))
            if how is not None:
                verdicts[node] = how
    members = None if world is None else set(world)
    return Judgement(mine, silent, quorum.isolated(me, set(mine), peers), condemned,
                     None if finished else loss.loss_of(me, verdicts, members))


def probe_targets(me: str, known: Iterable[str], present: Iterable[str],
                  suspected: Iterable[str] = (), neighbours: int = NEIGHBOURS) -> list[str]:
    """Whom one probe round asks: our ring successors among the present records, every
    present member a peer suspects (its vote counts only if we probe it too), and every
    known member whose record vanished (its confirmation)."""
    present = set(present)
    known = set(known) - {me}
    ring = ring_successors(me, known & present, neighbours)
    return sorted(set(ring) | (known & present & set(suspected)) | (known - present))


def roster_of(mine: PeerRecord, known: Mapping[str, PeerRecord], present: Iterable[str]) -> Roster:
    """What the round's live records say of their nodes, ours as we hold it (``vetting``).
    Plain torchrun joins no newcomer in place: nobody is entering."""
    records = {n: known[n] for n in present if n in known}
    records[mine.node] = mine
    return Roster({n: r.store for n, r in records.items() if r.store},
                  {n: r.world.generation for n, r in records.items() if r.world is not None})


def workers_generation(reported: GenerationId | None,
                       adopted: GenerationRecord | None) -> GenerationId | None:
    """Our workers' generation: the newer of what they report and what we handed them."""
    if adopted is not None and (reported is None or adopted.id.newer_than(reported)):
        return adopted.id
    return reported


@dataclass(frozen=True)
class Seen:
    """One tick's snapshot (``_Round._observe``): what ``plan`` decides from."""

    reported: GenerationId | None          # our workers' generation in this round
    finished: bool                         # our workers left their group
    completed: bool                        # ... by completing the job
    world: WorldView | None                # the world they report
    known: Mapping[str, PeerRecord]        # every member's last record seen this round
    present: frozenset[str]                # those whose record exists now
    answers: Mapping[str, Liveness]        # the last probe of each
    agreed: GenerationRecord | None        # the job's generation record (when listed)
    now: float


@dataclass(frozen=True)
class Step:
    """What one tick decided: the verdicts to remember, our record, the actions in order."""

    judgement: Judgement
    mine: PeerRecord
    actions: tuple[Action, ...]


def plan(me: str, seen: Seen, mine: PeerRecord, published: PeerRecord | None,
         adopted: GenerationRecord | None, prior: Judgement,
         silent_suspect_s: float) -> Step:
    """One tick's decision, purely, in the loops' vocabulary (``elasticd.actions``):
    WRITE_GENERATION a newer record of our round another survivor agreed (the backstop),
    PUBLISH our record when it changed (our workers' world, their completion, our
    suspicions), EVICT the members the majority condemned, SHRINK a loss."""
    actions: list[Action] = []
    new = mine
    if seen.world is not None and seen.world != new.world:
        new = replace(new, world=seen.world)
    if seen.completed and not new.done:
        new = replace(new, done=True)          # our departure soon is no loss
    known, answers = dict(seen.known), dict(seen.answers)
    world = None if adopted is None else adopted.nodes
    base = workers_generation(new.world.generation if new.world is not None else None, adopted)
    agreed = seen.agreed
    if (agreed is not None and base is not None and agreed.id.newer_than(base)
            and refusal(agreed, roster_of(new, seen.known, seen.present)) is None):
        actions.append(act(Kind.WRITE_GENERATION, record=agreed))
        world = agreed.nodes
        for node in agreed.lost:               # settled: no longer ours to judge
            known.pop(node, None)
            answers.pop(node, None)
    judgement = judge(me, known, seen.present, answers, world, seen.finished, prior, seen.now,
                      silent_suspect_s)
    suspects = frozenset(judgement.suspicions)
    if suspects != new.suspects:
        new = replace(new, suspects=suspects)
    if new != published:
        actions.append(act(Kind.PUBLISH, record=new))
    condemned = sorted(judgement.condemned & seen.present)
    if condemned:
        actions.append(act(Kind.EVICT, peers=tuple(condemned)))
    if judgement.loss is not None:
        actions.append(act(Kind.SHRINK, loss=judgement.loss, reported=seen.reported))
    return Step(judgement, new, tuple(actions))


def remove_stale_dirs(root: Path) -> list[Path]:
    """Remove the directories of agents that died without cleaning up (a SIGKILL):
    ``<DIR_PREFIX><pid>-*`` whose pid is gone. A live pid (even a reused one) is spared."""
    removed = []
    for path in root.glob(f"{DIR_PREFIX}*-*"):
        pid = path.name[len(DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not path.is_dir() or path.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


# -- the executor ----------------------------------------------------------------------------

class RecoveryCompanion:
    """The agent's side of in-place recovery (see the module docstring)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, addr: str, lease_ttl_s: int,
                 lease_interval_s: float) -> None:
        self._client = client
        self._keys = keys
        self._addr = addr
        self._ttl_s, self._lease_interval_s = max(lease_ttl_s, 2), lease_interval_s
        self._dir: Path | None = None
        self._probe: ProbeServer | None = None
        self._store = StoreHost(addr)
        self._lease: LeaseKeeper | None = None
        self._round: _Round | None = None
        self._lock = threading.Lock()
        self.enabled = False

    @property
    def generation_file(self) -> Path:
        assert self._dir is not None
        return self._dir / "generation.json"

    def start(self) -> RecoveryCompanion:
        """Host the probe and the store and take a lease; a failure disables the companion
        (logged: a lost peer then takes the restart path)."""
        try:
            remove_stale_dirs(Path(tempfile.gettempdir()))
            self._dir = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))
            atexit.register(self._remove_dir)
            self._probe = ProbeServer(self._addr).start()
            self._store.start()
            with no_retry(), deadline(ETCD_DEADLINE_S):
                self._lease = LeaseKeeper(self._client, self._ttl_s,
                                          interval_s=self._lease_interval_s,
                                          on_renewed=self._reattach,
                                          name="rdzv-recovery").start()
        except (OSError, EtcdError) as exc:
            log.warning("in-place recovery is off for this agent; a lost peer restarts the "
                        "workers", reason=str(exc), addr=self._addr)
            self.stop(done=False)
            return self
        self.enabled = self._store.endpoint is not None
        return self

    def on_world(self, round_: int, node_id: str) -> None:
        """A round completed: publish this agent's record and hand the workers the
        in-place settings (torchrun copies ``os.environ`` when it starts them)."""
        self.leave_round()
        if not self.enabled or self._probe is None or self._lease is None:
            os.environ["ELASTICD_RECOVERY_MODE"] = RESTART.value
            return
        with contextlib.suppress(FileNotFoundError):
            self.generation_file.unlink()
        progress = os.environ.get("ELASTICD_PROGRESS_FILE")
        if not progress:
            progress = str(self._dir / "progress.json")  # type: ignore[operator]
            os.environ["ELASTICD_PROGRESS_FILE"] = progress
        os.environ.update({"ELASTICD_RECOVERY_MODE": IN_PLACE.value,
                           "ELASTICD_GENERATION_FILE": str(self.generation_file),
                           "ELASTICD_NODE_ID": node_id})
        record = PeerRecord(node_id, self._probe.endpoint, self._store.endpoint)
        rnd = _Round(self, round_, record, Path(progress))
        with self._lock:
            self._round = rnd
        rnd.start()

    def leave_round(self, done: bool = False) -> None:
        """Stop acting for the current round (a new rendezvous, or shutdown)."""
        with self._lock:
            rnd, self._round = self._round, None
        if rnd is not None:
            rnd.stop(done)

    def stop(self, done: bool) -> None:
        """Shutdown. ``done``: the workers succeeded; the record says so and is left to
        expire with the lease (peers that probe us meanwhile read it), else revoked."""
        self.leave_round(done)
        if self._lease is not None:
            with no_retry(), deadline(ETCD_DEADLINE_S):
                self._lease.stop(revoke=not done)
            self._lease = None
        if self._probe is not None:
            self._probe.stop()
            self._probe = None
        self._store.stop()
        self.enabled = False
        self._remove_dir()

    def _reattach(self, lease: int) -> None:
        rnd = self._round
        if rnd is not None:
            rnd.publish(force=True)

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


class _Round:
    """One round's detection and agreement, on a daemon thread."""

    def __init__(self, owner: RecoveryCompanion, round_: int, mine: PeerRecord,
                 progress: Path) -> None:
        self.owner = owner
        self.round = round_
        self.mine = mine
        self.me = mine.node
        self.key = owner._keys.rdzv_recovery(round_) + self.me
        self.progress = ProgressReader(progress)
        self.published: PeerRecord | None = None
        self.known: dict[str, PeerRecord] = {}
        self.present: set[str] = set()
        self.answers: dict[str, Liveness] = {}
        self.adopted: GenerationRecord | None = None
        self.finished = False
        self.judgement = Judgement()
        self.reported_fail: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="elasticd-rprobe")
        self._thread = threading.Thread(target=self._run, name="elasticd-recovery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, done: bool) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            with no_retry(), deadline(ETCD_DEADLINE_S):
                if done:
                    self.mine = replace(self.mine, done=True)
                    self.publish(force=True)
                else:
                    self.owner._client.delete(self.key)
        except EtcdError as exc:
            log.debug("could not update the recovery record", reason=str(exc))

    # -- the loop: observe, decide (``plan``, pure), act (``_ACTIONS``)
    def _run(self) -> None:
        next_list = 0.0
        while not self._stop.wait(PROBE_INTERVAL_S):
            now = time.monotonic()
            list_now = now >= next_list
            if list_now:
                next_list = now + LIST_INTERVAL_S
            try:
                self._tick(list_now)
            except EtcdError as exc:
                log.debug("recovery companion: etcd call failed; retried", reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - the companion must never kill the agent
                log.warning("recovery companion error; retried", error=repr(exc)[:300])

    def _tick(self, list_now: bool) -> None:
        seen = self._observe(list_now)
        was = self.judgement
        step = plan(self.me, seen, self.mine, self.published, self.adopted, was,
                    self.owner._ttl_s)
        self.judgement, self.mine = step.judgement, step.mine
        self._report(was, step.judgement)
        for action in step.actions:
            if action.kind is Kind.SHRINK and self._stop.is_set():
                break   # the round ended while we decided: torchrun's business now
            _ACTIONS[action.kind](self, action)

    def _observe(self, list_now: bool) -> Seen:
        """One snapshot: our workers' progress, the round's records (re-listed when due,
        or while a suspicion's votes are in the others' fresh records), the job's
        generation key, then a probe round."""
        progress = self.progress.read()
        reported = progress.generation
        if reported is not None and reported.round != self.round:
            reported = None        # the previous round's workers' last record
        agreed = None
        if list_now or not self.known or self.judgement.suspicions:
            with no_retry(), deadline(ETCD_DEADLINE_S):
                agreed = self._list()
        self._probe_round()
        return Seen(reported=reported,
                    finished=reported is not None and progress.event in FINISHED,
                    completed=reported is not None and progress.event == "completed",
                    world=progress.world(self.me) if reported is not None else None,
                    known=dict(self.known), present=frozenset(self.present),
                    answers=dict(self.answers), agreed=agreed, now=time.monotonic())

    def _report(self, was: Judgement, now: Judgement) -> None:
        """One line when this companion is cut off from the majority, and when it is back."""
        if now.isolated != was.isolated:
            log.warning("this agent reaches only a minority of the round's members: it "
                        "condemns nobody and waits" if now.isolated else
                        "this agent reaches the majority of the round's members again",
                        round=self.round, suspects=sorted(now.suspicions))

    def publish(self, force: bool = False) -> None:
        if not force and self.published == self.mine:
            return
        lease = self.owner._lease
        if lease is None:
            return
        self.owner._client.put(self.key, self.mine.encode(), lease.id)
        self.published = self.mine

    def _list(self) -> GenerationRecord | None:
        """Refresh the round's records; the job's generation record, if one is readable."""
        keys = self.owner._keys
        prefix = keys.rdzv_recovery(self.round)
        found, _ = self.owner._client.get_many([keys.generation])
        kvs, _ = self.owner._client.list_prefix(prefix)
        present = set()
        for kv in kvs:
            node = kv.key[len(prefix):]
            record = PeerRecord.decode(node, kv.value)
            if record is not None:
                self.known[node] = record
                present.add(node)
        self.present = present
        kv = found.get(keys.generation)
        if kv is None:
            return None
        try:
            return GenerationRecord.from_json(kv.value)
        except GenerationRecordError:
            return None

    def _probe_round(self) -> None:
        suspected = {n for r in self.known.values() for n in r.suspects}
        targets = probe_targets(self.me, self.known, self.present, suspected)
        if not targets:
            return
        try:
            answers = list(self._pool.map(
                lambda n: probe(self.known[n].probe, PROBE_TIMEOUT_S), targets))
        except RuntimeError:
            return   # the pool was shut down: the round ended
        self.answers.update(zip(targets, answers, strict=True))

    # -- the executors: each carries out one action and logs what came of it
    def _publish(self, action: Action) -> None:
        with no_retry(), deadline(ETCD_DEADLINE_S):
            self.publish()

    def _evict(self, action: Action) -> None:
        """The majority's verdict: every survivor's listing sees the records gone at once."""
        prefix = self.owner._keys.rdzv_recovery(self.round)
        with no_retry(), deadline(ETCD_DEADLINE_S):
            for node in action["peers"]:
                self.owner._client.delete(prefix + node)
                self.present.discard(node)

    def _write_generation(self, action: Action) -> None:
        """A record of our round agreed by another survivor: hand it over too (the backstop)."""
        record: GenerationRecord = action["record"]
        self._hand_over(record)
        log.info(f"lost {', '.join(record.lost)} ({record.cause}): generation {record.id} "
                 f"agreed in place by another survivor, {len(record.nodes)} nodes; handed "
                 "to the workers", event_kind="recovery", round=self.round,
                 lost=list(record.lost), generation=str(record.id), wrote=False,
                 status="ok" if record.member(self.me) else "fenced")

    def _shrink(self, action: Action) -> None:
        loss: Loss = action["loss"]
        started = time.monotonic()
        workers = workers_generation(action["reported"], self.adopted)
        if workers is None:
            self._failed(loss, "our workers have not reported their generation yet")
            return
        views = [r.world for r in self.known.values() if r.world is not None]
        roster = roster_of(self.mine, self.known, self.present)
        with deadline(SHRINK_BUDGET_S + ETCD_DEADLINE_S):
            out = shrink_world(self.owner._client, self.owner._keys, self.me, loss.lost,
                               loss.cause, workers, views, roster, deadline_s=SHRINK_BUDGET_S)
        if out.status in ("ok", "fenced") and out.record is not None:
            self._hand_over(out.record)
            if out.wrote:
                with contextlib.suppress(EtcdError):
                    admin.release_exit_barrier(self.owner._client, self.owner._keys,
                                               self.round, ETCD_DEADLINE_S)
            took = time.monotonic() - started
            log.info(f"lost {', '.join(loss.lost)} ({loss.cause}): "
                     + (f"generation {out.record.id} agreed in place, {len(out.record.nodes)} "
                        f"nodes, in {took:.3f} s" if out.status == "ok" else
                        f"generation {out.record.id} leaves this node out (fenced); its "
                        "workers exit for a restart"),
                     event_kind="recovery", round=self.round, lost=list(loss.lost),
                     generation=str(out.record.id), wrote=out.wrote, status=out.status)
        elif out.status == "unneeded":
            for node in loss.lost:
                self.known.pop(node, None)
        else:
            self._failed(loss, out.reason)

    def _failed(self, loss: Loss, reason: str) -> None:
        if loss.lost != self.reported_fail:
            self.reported_fail = loss.lost
            log.warning(f"lost {', '.join(loss.lost)} ({loss.cause}) but no in-place "
                        "generation; the workers take the restart path", reason=reason,
                        round=self.round)

    def _hand_over(self, record: GenerationRecord) -> None:
        hand_over(str(self.owner.generation_file), record)
        self.owner._store.prune(record.id)
        self.adopted = record
        for node in record.lost:
            self.answers.pop(node, None)
            self.known.pop(node, None)


# The companion's words of the loops' vocabulary (elasticd.actions) and who carries each out.
_ACTIONS: dict[Kind, Callable[[_Round, Action], None]] = {
    Kind.WRITE_GENERATION: _Round._write_generation,
    Kind.PUBLISH: _Round._publish,
    Kind.EVICT: _Round._evict,
    Kind.SHRINK: _Round._shrink,
}
