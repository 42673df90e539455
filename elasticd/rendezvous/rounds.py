"""Keyed rounds: the rules of the rendezvous whose etcd writes grow linearly with the nodes.

torch's dynamic rendezvous keeps one pickled state that every agent compare-and-sets on
every join and every heartbeat: O(N) attempts per successful write, O(N^2) per round
(docs/scale.md measured no world of 128 within 120 s). Keyed rounds give each agent its
own keys instead, all on the agent's liveness lease (``keys.py``):

- ``alive/<agent>``: exists while the agent lives (its heartbeat is the lease keep-alive,
  not a write of anything shared);
- ``join/<round>/<agent>``: the agent wants a place in ``round`` (one put per agent);
- ``world/<round>``: the closed round's members, created once by the round's leader (the
  oldest joiner) in one transaction that also moves the small ``round`` pointer.

This module holds the rules as pure functions of what was read (no I/O, no clock of its
own), tested without etcd; ``keyed.py`` reads, decides and writes.

Round ``R`` closes (``decide``) when, in this order:

1. ``max_nodes`` agents joined: at once, with the first ``max_nodes`` joiners;
2. some member of world ``R-1`` is still alive and has not joined: never yet (torch waits
   the same way for every participant of the complete round to leave it, so a restart
   that one node asked for does not form a world without the others);
3. ``min_nodes`` joined: ``last_call_s`` after the leader first saw that (torch's last call);
4. else: not yet.

Ranks are the members' order sorted by (addr, pid, local id), as torch sorts its
participants when it completes a round.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from elasticd.errors import EtcdError


class CorruptRoundError(RendezvousStateError, EtcdError):
    """A keyed-round record in etcd that this plugin did not write (corrupt or tampered).

    torch's ``RendezvousStateError`` (what torch's own backends raise for a corrupt
    state) and an ``EtcdError`` (what the daemon handles for every read of etcd).
    """


@dataclass(frozen=True, order=True)
class Agent:
    """One torchrun agent in the rendezvous: torch's ``_NodeDesc`` fields."""

    addr: str
    pid: int
    local_id: int = 0

    @property
    def name(self) -> str:
        """The agent's key name (torch's ``repr`` of a ``_NodeDesc``)."""
        return f"{self.addr}_{self.pid}_{self.local_id}"

    def to_json(self) -> list[Any]:
        return [self.addr, self.pid, self.local_id]

    @classmethod
    def from_json(cls, value: Any) -> Agent:
        if (not isinstance(value, list) or len(value) != 3 or not isinstance(value[0], str)
                or not all(type(v) is int for v in value[1:])):
            raise ValueError(f"an agent is [addr, pid, local_id], not {value!r:.80}")
        agent = cls(value[0], value[1], value[2])
        if "/" in agent.addr or not agent.addr:
            raise ValueError(f"agent address {agent.addr!r} is empty or holds '/'")
        return agent


@dataclass(frozen=True)
class World:
    """A closed round: its number and its members in rank order."""

    round: int
    members: tuple[Agent, ...]

    def rank_of(self, agent: Agent) -> int | None:
        try:
            return self.members.index(agent)
        except ValueError:
            return None

    def encode(self) -> bytes:
        return json.dumps({"round": self.round,
                           "members": [m.to_json() for m in self.members]}).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str) -> World:
        """The record at ``key``, checked field by field (JSON only: nothing is executed)."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or type(data.get("round")) is not int or data["round"] < 0:
                raise ValueError("'round' is not a whole number >= 0")
            members = data.get("members")
            if not isinstance(members, list) or not members:
                raise ValueError("'members' is not a non-empty list")
            world = cls(data["round"], tuple(Agent.from_json(m) for m in members))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptRoundError(
                f"the rendezvous record at {key} is not one this plugin wrote (corrupt or "
                f"tampered with: {exc}); it was not used. Stop the job's agents and delete the "
                f"job's rendezvous keys (etcdctl del --prefix {key.rsplit('/rdzv/', 1)[0]}/rdzv/); "
                "the next agent starts a fresh rendezvous") from None
        return world


def encode_pointer(world: World) -> bytes:
    """The small ``round`` pointer: what the daemons read every second."""
    return json.dumps({"round": world.round, "size": len(world.members)}).encode()


def decode_pointer(raw: bytes, key: str) -> tuple[int, int]:
    """(round, world size) of the pointer at ``key``; ``CorruptRoundError`` if it is not one."""
    try:
        data = json.loads(raw)
        round_, size = data["round"], data["size"]
        if type(round_) is not int or type(size) is not int or round_ < 0 or size < 1:
            raise ValueError(f"round={round_!r} size={size!r}")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise CorruptRoundError(
            f"the rendezvous pointer at {key} is not one this plugin wrote ({exc!r:.100}); "
            f"delete it (etcdctl del {key}) with the job's agents stopped") from None
    return round_, size


@dataclass(frozen=True)
class Joined:
    agent: Agent
    create_revision: int      # etcd's order of the joins: the oldest joiner leads the round


@dataclass(frozen=True)
class Snapshot:
    """What the leader of round ``round`` read, at one etcd revision."""

    round: int
    joined: tuple[Joined, ...]
    previous: World | None        # world ``round - 1``, if there was one
    alive: frozenset[Agent]       # the previous members whose liveness key still exists


@dataclass(frozen=True)
class Rules:
    min_nodes: int
    max_nodes: int
    last_call_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"--nnodes={self.min_nodes}:{self.max_nodes}: need 1 <= min <= max")


@dataclass(frozen=True)
class Decision:
    close: bool
    members: tuple[Agent, ...] = ()     # rank order, when ``close``
    ready_since: float | None = None    # when ``min_nodes`` stood unblocked (for the last call)
    wait_s: float | None = None         # re-decide at the latest after this (None: on news)
    reason: str = ""
    blocked: bool = False               # live members of the previous world hold it open


def by_join_order(joined: tuple[Joined, ...]) -> tuple[Agent, ...]:
    return tuple(j.agent for j in sorted(joined, key=lambda j: j.create_revision))


def blocking(snapshot: Snapshot) -> tuple[Agent, ...]:
    """Members of the previous world that are alive and have not joined this round."""
    if snapshot.previous is None:
        return ()
    joined = {j.agent for j in snapshot.joined}
    return tuple(m for m in snapshot.previous.members if m in snapshot.alive and m not in joined)


def decide(snapshot: Snapshot, rules: Rules, ready_since: float | None, now: float) -> Decision:
    """Whether round ``snapshot.round`` closes now, with whom, or how long to wait."""
    order = by_join_order(snapshot.joined)
    if len(order) >= rules.max_nodes:
        return Decision(True, tuple(sorted(order[:rules.max_nodes])),
                        reason=f"max_nodes={rules.max_nodes} joined")
    blockers = blocking(snapshot)
    if blockers:
        return Decision(False, blocked=True, reason=f"waiting for {len(blockers)} live member(s) of round "
                                      f"{snapshot.round - 1} (e.g. {blockers[0].name})")
    if len(order) < rules.min_nodes:
        return Decision(False, reason=f"{len(order)} of min_nodes={rules.min_nodes} joined")
    since = now if ready_since is None else ready_since
    left = since + rules.last_call_s - now
    if left > 0:
        return Decision(False, ready_since=since, wait_s=left,
                        reason=f"{len(order)} joined; last call for {left:.2f} s")
    return Decision(True, tuple(sorted(order)), ready_since=since,
                    reason=f"{len(order)} joined and the last call passed")


def nodes_waiting(live_members: int, next_joins: int, rules: Rules) -> int:
    """torch's ``num_nodes_waiting`` for a member of a world with ``live_members`` live
    members: the joins to the next round, unless the world is full (torch's redundancy
    list waits silently)."""
    return 0 if live_members >= rules.max_nodes else next_joins


def staying_members(members: Iterable[str], alive: Set[str], joined_next: Set[str]) -> int:
    """Members of a world still in it: alive, and not already waiting in the next round.

    A member that rejoins the next round has left its world, though its liveness key is
    alive again (seen on the chaos matrix: a node frozen past its lease woke up, found the
    world re-formed in place without it and rejoined; counted as a live member of the full
    world, its join was "a spare" to the others, while its round waited for them: the
    world never grew back)."""
    return sum(1 for m in members if m in alive and m not in joined_next)
