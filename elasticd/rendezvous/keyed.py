"""The keyed-rounds rendezvous handler (``--rdzv-conf rounds=keyed``): reads, decides, writes.

The rules are ``rounds.py``'s pure functions; this module is the executor around them,
every step bounded by the join deadline. Per round each agent writes one join key (on
its liveness lease) and deletes its previous one; the round's leader (its oldest joiner)
lists the joins, decides, and writes the world in one transaction; the others watch
that one key. At steady state an agent writes nothing: its heartbeat is the keep-alive
of its liveness lease, and ``num_nodes_waiting`` is one count-only read a second.
The daemon's eviction of a dead agent is the revocation of that lease (``admin.py``),
which removes its liveness and its join at once.

The job's own records (the ``round`` pointer, the ``world/<round>`` records and the
``epoch``) are on no lease: they outlive every agent, as the job does. A record on its
writer's lease vanished with that agent's lease 2 h after the round's leader was lost
while the others trained on in place, and the next rendezvous then started again at
round 0 under a new epoch (a second world beside the first; the job's checkpoints
overwritten). Round numbers only go up within a job: a round is joined above every
round that has a record, and a round closes only while the pointer is the one its
leader read (a compare-and-set), so a leader that froze and woke up late cannot move the
pointer back. A record this plugin cannot read is stepped over (one warning), never
fatal: the next close writes a good pointer above it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import structlog
from torch.distributed import PrefixStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from elasticd.errors import EtcdError
from elasticd.etcd_client import EtcdClient, KeyValue, no_retry
from elasticd.lease import LeaseKeeper
from elasticd.rendezvous import BACKEND_NAME, entering
from elasticd.rendezvous.closed import closed_message
from elasticd.rendezvous.joins import count_joins, oldest_join, read_joins
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.leaving import LeavesOnExit, warn_giving_up
from elasticd.rendezvous.rounds import (
    Agent,
    CorruptRoundError,
    Joined,
    Rules,
    Snapshot,
    World,
    decide,
    decode_pointer,
    encode_pointer,
    nodes_waiting,
    staying_members,
)

if TYPE_CHECKING:   # the companion is imported only when recovery=in-place (handler.py)
    from elasticd.rendezvous.companion import RecoveryCompanion

T = TypeVar("T")

log = structlog.get_logger(__name__)
# torch's own logger of rendezvous events: "has joined round" lines keep their usual home.
_torch_log = logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous")

# A follower re-checks that its round's leader still has its join this often.
FOLLOWER_POLL_S = 1.0
# The leader re-reads the previous members' liveness this often while they block it.
LEADER_POLL_S = 0.25
# After a join wakes the leader, it waits this long for more before listing again.
LEADER_BATCH_S = 0.02
WAITING_CACHE_S = 1.0
_LOCAL_IDS = itertools.count()   # torch's _NodeDescGenerator: unique per process


class KeyedRendezvousHandler(LeavesOnExit, RendezvousHandler):
    """torch's ``RendezvousHandler`` on keyed rounds in etcd."""

    def __init__(self, run_id: str, client: EtcdClient, keys: JobKeys, store: Store,
                 run_lease: LeaseKeeper, rules: Rules, local_addr: str | None, *,
                 join_timeout_s: float, keep_alive_interval_s: int, keep_alive_max_attempt: int,
                 on_world: Callable[[int, RendezvousInfo], None] | None = None,
                 companion: RecoveryCompanion | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._run_id = run_id
        self._client = client
        self._keys = keys
        self._store = store
        self._run_lease = run_lease
        self._rules = rules
        self.agent = Agent(local_addr or socket.getfqdn(), os.getpid(), next(_LOCAL_IDS))
        self._join_timeout_s = join_timeout_s
        self._alive = LeaseKeeper(client, keep_alive_interval_s * keep_alive_max_attempt,
                                  interval_s=keep_alive_interval_s, on_renewed=self._reattach,
                                  name="rdzv-alive")
        self._alive_started = False
        self._joined: int | None = None       # the round this agent's join key is in
        self.world: World | None = None       # the last world this agent was admitted to
        self._on_world = on_world
        self.companion = companion
        self._clock = clock
        self._waiting = (float("-inf"), 0)
        self._warned: set[tuple[str, int]] = set()

    # -- torch's interface -------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        return False

    def get_run_id(self) -> str:
        return self._run_id

    def is_closed(self) -> bool:
        return self._etcd(lambda: self._client.get(self._keys.rdzv_closed)) is not None

    def set_closed(self) -> None:
        self._etcd(lambda: self._client.put(self._keys.rdzv_closed, b"{}", self._run_lease.id))

    def next_rendezvous(self) -> RendezvousInfo:
        self._leave_if_asked()
        entry = entering.take_entry()
        if entry is not None:
            return self._enter_alone(entry)
        entering.ordinary()
        end = self._clock() + self._join_timeout_s
        if self.companion is not None:
            self.companion.leave_round()
        self._ensure_alive()
        self._arm_leave_on_exit()
        round_ = self._next_round()
        while True:
            self._join(round_)
            try:
                world = self._await_world(round_, end)
            except _RoundPassed as passed:
                round_ = passed.next_round
                continue
            rank = world.rank_of(self.agent)
            if rank is not None:
                break
            log.info("round closed without this agent; joining the next", round=world.round,
                     world_size=len(world.members))
            round_ = world.round + 1
        self.world = world
        self._waiting = (float("-inf"), 0)
        store = PrefixStore(f"torch.rendezvous.{self._run_id}.{world.round}", self._store)
        info = RendezvousInfo(store, rank, len(world.members),
                              RendezvousStoreInfo.build(rank, store, local_addr=self.agent.addr))
        _torch_log.info(f"The node '{self.agent.name}' has joined round {world.round} of the "
                        f"rendezvous '{self._run_id}' as rank {rank} in a world of size "
                        f"{len(world.members)}.")
        if self._on_world is not None:
            self._on_world(world.round, info)
        if self.companion is not None:
            self.companion.on_world(world.round, self.agent.name)
        return info

    def _enter_alone(self, entry: entering.Entry) -> RendezvousInfo:
        """A join in place (``entering``): a world of this agent alone. It watches the
        live world's next round as a member's agent does (a node waiting for it restarts
        everyone, the newcomer too)."""
        self._ensure_alive()
        self._arm_leave_on_exit()
        self.world = self._read_world(entry.generation.round)
        self._waiting = (float("-inf"), 0)
        return entering.alone(self._run_id, self._store, self.agent.name, self.agent.addr,
                              entry, self._on_world or (lambda round_, info: None))

    def num_nodes_waiting(self) -> int:
        """Joins to the round after this agent's world (one count-only read a second).

        An outage counts as "nobody waits": training goes on while etcd is down, and only
        membership changes wait for it (torch's agent dies on any exception here).
        """
        if self.world is None:
            return 0
        now = self._clock()
        if now - self._waiting[0] < WAITING_CACHE_S:
            return self._waiting[1]
        names = [m.name for m in self.world.members]
        following = self._keys.rdzv_joins(self.world.round + 1)
        try:
            with no_retry():
                joins = count_joins(self._client, self._keys, self.world.round + 1,
                                    self._warn_join)
                live = len(names)
                if joins and live >= self._rules.max_nodes:
                    # A full world turns newcomers away, unless members died since it formed
                    # (an in-place shrink keeps this world) or already wait in the next
                    # round: count the ones still in it.
                    alive = self._keys.rdzv_alive
                    found, _ = self._client.get_many([alive + n for n in names]
                                                     + [following + n for n in names])
                    live = staying_members(names, {n for n in names if alive + n in found},
                                           {n for n in names if following + n in found})
        except EtcdError as exc:
            log.debug("etcd unreachable; assuming no node is waiting", reason=str(exc))
            return 0
        self._waiting = (now, nodes_waiting(live, joins, self._rules))
        return self._waiting[1]

    def shutdown(self) -> bool:
        """Close the rendezvous only when this agent's workers succeeded (as ``handler.py``
        explains for torch's handler), and leave it in every case."""
        return self._leave_once(success=sys.exc_info()[1] is None)

    def _leave(self, success: bool) -> bool:
        if self.companion is not None:
            self.companion.stop(done=success)
        if success:
            try:
                self.set_closed()
            except RendezvousConnectionError as exc:
                log.warning("could not close the rendezvous", reason=str(exc))
        else:
            warn_giving_up(self._asked_to_leave, agent=self.agent.name)
        # Revoking the liveness lease removes this agent's liveness and join keys at once.
        self._alive.stop(revoke=True)
        self._alive_started = False
        return True

    # -- the steps ---------------------------------------------------------------------

    def _closed_error(self) -> RendezvousClosedError:
        # torchrun prints it as its last line: it says that the run completed and the fix.
        return RendezvousClosedError(closed_message(self._run_id, self._keys,
                                                    self._client.settings, self._run_lease.ttl_s))

    def _etcd(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except EtcdError as exc:
            raise RendezvousConnectionError(f"etcd3 rendezvous: {exc}") from exc

    def _ensure_alive(self) -> None:
        if not self._alive_started:
            self._etcd(self._alive.start)
            self._alive_started = True
            self._reattach(self._alive.id)

    def _reattach(self, lease: int) -> None:
        """(Re)write this agent's keys on its liveness lease (a new lease after an expiry)."""
        value = json.dumps(self.agent.to_json()).encode()
        self._etcd(lambda: self._client.put(self._keys.rdzv_alive + self.agent.name, value, lease))
        joined = self._joined
        if joined is not None and (self.world is None or joined > self.world.round):
            self._etcd(lambda: self._client.put(self._join_key(joined), value, lease))

    def _join_key(self, round_: int) -> str:
        return f"{self._keys.rdzv_joins(round_)}{self.agent.name}"

    def epoch(self) -> str:
        """The job's rendezvous epoch: one id for the job's whole life (on no lease)."""
        key = self._keys.rdzv_epoch
        kv = self._etcd(lambda: self._client.get(key))
        if kv is None:
            _, kv = self._etcd(lambda: self._client.put_or_create(
                key, uuid.uuid4().hex.encode(), None))
        if kv is None:
            raise RendezvousConnectionError(f"etcd3 rendezvous: {key} vanished as it was made")
        return kv.value.decode("ascii", "replace")

    def _next_round(self) -> int:
        """The round above every round that has a record: the pointer's, and any world's."""
        found, _ = self._etcd(lambda: self._client.get_many(
            [self._keys.rdzv_round, self._keys.rdzv_closed]))
        if self._keys.rdzv_closed in found:
            raise self._closed_error()
        worlds, _ = self._etcd(lambda: self._client.list_prefix(self._keys.rdzv_worlds))
        rounds = [r for r in (self._keys.world_round(kv.key) for kv in worlds) if r is not None]
        pointed = self._pointer_round(found.get(self._keys.rdzv_round))
        if pointed is not None:
            rounds.append(pointed)
        return max(rounds, default=-1) + 1

    def _pointer_round(self, pointer: KeyValue | None) -> int | None:
        """The pointer's round; None when absent or unreadable (stepped over: the next
        close replaces it)."""
        if pointer is None:
            return None
        try:
            return decode_pointer(pointer.value, pointer.key)[0]
        except CorruptRoundError as exc:
            self._warn_once(pointer, str(exc))
            return None

    def _warn_once(self, kv: KeyValue, problem: str,
                   event: str = "stepping over a rendezvous record this plugin cannot read; "
                                "the next round closes above it") -> None:
        if (kv.key, kv.mod_revision) not in self._warned:
            self._warned.add((kv.key, kv.mod_revision))
            log.warning(event, key=kv.key, problem=problem[:600])

    def _warn_join(self, kv: KeyValue, problem: str) -> None:
        self._warn_once(kv, problem, "ignoring a join key that counts for no agent")

    def _put_alive(self, key: str, value: bytes) -> None:
        """Put ``key`` on the liveness lease; if that lease expired (this agent was starved
        of CPU for its TTL, or etcd lost it), renew it first, which re-attaches the keys."""
        try:
            self._client.put(key, value, self._alive.id)
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise RendezvousConnectionError(f"etcd3 rendezvous: {exc}") from exc
            log.warning("the liveness lease had expired; renewing it", agent=self.agent.name)
            self._alive.refresh_once()
            self._etcd(lambda: self._client.put(key, value, self._alive.id))

    def _join(self, round_: int) -> None:
        value = json.dumps(self.agent.to_json()).encode()
        previous = self._joined
        self._put_alive(self._join_key(round_), value)
        self._joined = round_
        if previous is not None and previous != round_:
            self._etcd(lambda: self._client.delete(self._join_key(previous)))

    def _await_world(self, round_: int, end: float) -> World:
        """World ``round_`` once it closes; ``_RoundPassed`` if the job's rounds went past
        it (its record was stepped over, or the pointer is already at or above it)."""
        previous = self._read_world(round_ - 1) if round_ > 0 else None
        ready_since: float | None = None
        world_key, mine = self._keys.rdzv_world(round_), self._join_key(round_)
        while True:
            if self._clock() >= end:
                raise RendezvousTimeoutError(
                    f"round {round_} of {self._run_id} did not close within join_timeout="
                    f"{self._join_timeout_s:.0f} s (min_nodes={self._rules.min_nodes}); start more "
                    "nodes or raise --rdzv-conf join_timeout")
            found, revision = self._etcd(lambda: self._client.get_many(
                [world_key, self._keys.rdzv_closed, mine, self._keys.rdzv_round]))
            if self._keys.rdzv_closed in found:
                raise self._closed_error()
            if world_key in found:
                return self._decode_world(found[world_key], round_)
            pointer = found.get(self._keys.rdzv_round)
            pointed = self._pointer_round(pointer)
            if pointed is not None and pointed >= round_:
                # A late leader's round (its world record pruned since): join the next.
                raise _RoundPassed(pointed + 1)
            if mine not in found:
                self._join(round_)       # our join is gone (lease lost, or evicted): again
                continue
            if self._leads(round_):
                fence = 0 if pointer is None else pointer.mod_revision
                ready_since = self._lead(round_, previous, ready_since, fence)
            else:
                self._etcd(lambda rev=revision: self._client.wait_for_change(world_key, rev,
                                                                            FOLLOWER_POLL_S))

    def _leads(self, round_: int) -> bool:
        """Whether this agent leads round ``round_``: its oldest join that counts."""
        return self._etcd(lambda: oldest_join(self._client, self._keys, round_,
                                              self._warn_join, mine=self.agent)) == self.agent

    def _lead(self, round_: int, previous: World | None, ready_since: float | None,
              fence: int) -> float | None:
        """One decision as the round's leader: close it, or wait for news (bounded).
        ``fence``: the pointer's mod revision when this leader read it (0: absent)."""
        joined, revision = self._etcd(lambda: read_joins(self._client, self._keys, round_,
                                                         self._warn_join))
        snapshot = Snapshot(round_, joined, previous, self._alive_among(previous, joined))
        decision = decide(snapshot, self._rules, ready_since, self._clock())
        if decision.close:
            self._close(World(round_, decision.members), decision.reason, fence)
            return None
        wait_s = LEADER_POLL_S if decision.blocked else min(decision.wait_s or FOLLOWER_POLL_S,
                                                            FOLLOWER_POLL_S)
        if self._etcd(lambda: self._client.wait_for_change(self._keys.rdzv_joins(round_),
                                                           revision, wait_s)):
            time.sleep(LEADER_BATCH_S)
        return decision.ready_since

    def _alive_among(self, previous: World | None, joined: tuple[Joined, ...]) -> frozenset[Agent]:
        if previous is None:
            return frozenset()
        absent = [m for m in previous.members if m not in {j.agent for j in joined}]
        if not absent:
            return frozenset()
        found, _ = self._etcd(lambda: self._client.get_many(
            [self._keys.rdzv_alive + m.name for m in absent]))
        return frozenset(m for m in absent if self._keys.rdzv_alive + m.name in found)

    def _close(self, world: World, reason: str, fence: int) -> None:
        """Write world and pointer on no lease (they outlive every agent), only if the
        world is new and the pointer is still the one read (``fence``): never backwards."""
        won = self._etcd(lambda: self._client.create_all(
            {self._keys.rdzv_world(world.round): (world.encode(), None),
             self._keys.rdzv_round: (encode_pointer(world), None)},
            first=self._keys.rdzv_world(world.round),
            deletes=(self._keys.rdzv_world(world.round - 2),) if world.round >= 2 else (),
            unchanged={self._keys.rdzv_round: fence}))
        if won:
            log.info("closed the round", round=world.round, world_size=len(world.members),
                     reason=reason)

    def _read_world(self, round_: int) -> World | None:
        """World ``round_``; None when absent or unreadable (then nobody blocks the next)."""
        key = self._keys.rdzv_world(round_)
        kv = self._etcd(lambda: self._client.get(key))
        if kv is None:
            return None
        try:
            return self._decode_world(kv, round_)
        except _RoundPassed:
            return None

    def _decode_world(self, kv: KeyValue, round_: int) -> World:
        try:
            world = World.decode(kv.value, kv.key)
            if world.round != round_:
                raise CorruptRoundError(f"the record at {kv.key} is of round {world.round}")
        except CorruptRoundError as exc:
            self._warn_once(kv, str(exc))
            raise _RoundPassed(round_ + 1) from None
        return world


class _RoundPassed(Exception):
    """The job's rounds went past the one an agent joined: join ``next_round``."""

    def __init__(self, next_round: int) -> None:
        super().__init__(next_round)
        self.next_round = next_round
