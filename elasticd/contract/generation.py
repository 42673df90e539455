"""One definition of a generation: the world a worker belongs to, shared by daemon and trainer.

A generation is ``(epoch, round, seq)``:

* ``epoch``: the id of the rendezvous state's lifetime (``ELASTICD_GENERATION_EPOCH``);
* ``round``: torch's rendezvous round (``ELASTICD_GENERATION``); every torchrun
  restart of the workers is a new round;
* ``seq``: the in-place re-forms within that round; 0 for the world torchrun formed.

Within one epoch generations are ordered by ``(round, seq)``. A worker of an older
generation can never commit a checkpoint (the checkpoint fence compares these) or
enter a newer group (it is not a member of the newer record, and each generation's
group forms under its own store prefix).

A ``GenerationRecord`` is what the daemons agree on in etcd (``JobKeys.generation``,
one compare-and-set per re-form) and what each daemon hands its workers in the
local generation file (``ELASTICD_GENERATION_FILE``): the members in rank order,
each with its process count, and the TCP store, hosted by the first member's
daemon, through which the new group forms. It holds no code: it is parsed from
JSON and validated field by field.

This module is torch-free (the daemon and the trainer both import it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

FORMAT = 1


class GenerationRecordError(ValueError):
    """A generation record is malformed; the message names the field and what was expected."""


@dataclass(frozen=True)
class GenerationId:
    """``round.seq`` within ``epoch``; see the module docstring."""

    round: int
    seq: int = 0
    epoch: str | None = None

    def __post_init__(self) -> None:
        _require(_is_count(self.round), "round", self.round, "an integer >= 0")
        _require(_is_count(self.seq), "seq", self.seq, "an integer >= 0")
        _require(self.epoch is None or (isinstance(self.epoch, str) and 0 < len(self.epoch) <= 128),
                 "epoch", self.epoch, "null or a string of 1-128 characters")

    def same_round(self, other: GenerationId) -> bool:
        """Both are re-forms of one torchrun round (of one rendezvous lifetime)."""
        return self.epoch == other.epoch and self.round == other.round

    def newer_than(self, other: GenerationId) -> bool:
        """A later re-form of the same round (records of other rounds are never compared)."""
        return self.same_round(other) and self.seq > other.seq

    @property
    def store_prefix(self) -> str:
        """The key prefix a group of this generation forms under (one per generation)."""
        return f"elasticd/{self.epoch or '-'}/{self.round}/{self.seq}/"

    def next(self) -> GenerationId:
        return replace(self, seq=self.seq + 1)

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "seq": self.seq, "epoch": self.epoch}

    @classmethod
    def from_dict(cls, raw: Any) -> GenerationId:
        if not isinstance(raw, Mapping):
            raise GenerationRecordError(f"generation must be an object, got {raw!r}")
        return cls(raw.get("round"), raw.get("seq", 0), raw.get("epoch"))  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.round}.{self.seq}"


@dataclass(frozen=True)
class Member:
    """A node of a generation: its id, its first global rank and how many workers it runs."""

    node: str
    first_rank: int
    nproc: int

    def __post_init__(self) -> None:
        _require(isinstance(self.node, str) and self.node != "", "member node", self.node,
                 "a non-empty node id")
        _require(_is_count(self.first_rank), "member first_rank", self.first_rank,
                 "an integer >= 0")
        _require(_is_count(self.nproc) and self.nproc >= 1, "member nproc", self.nproc,
                 "an integer >= 1")


@dataclass(frozen=True)
class GenerationRecord:
    """The membership of one generation and where its group forms."""

    id: GenerationId
    members: tuple[Member, ...]
    store: str | None = None            # HOST:PORT of the TCP store the group forms through
    lost: tuple[str, ...] = ()          # the nodes this generation left behind
    cause: str = ""                     # why it was made (peer-crashed, peer-silent, ...)
    created: float = field(default=0.0, compare=False)  # wall clock, for people
    # A planned change (a join, a drain): the current world agrees the step it takes
    # effect after, so it releases no collective; a loss's record (False) takes effect at
    # once. ``joined``: the members new in it, who enter with no state of their own (a
    # join's, or the warm spares a loss's record takes in the lost nodes' place).
    planned: bool = False
    joined: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(len(self.members) >= 1, "members", list(self.members), "at least one member")
        expected = 0
        for m in self.members:
            _require(m.first_rank == expected, "members", [m.node for m in self.members],
                     f"contiguous ranks from 0 (member {m.node} starts at {m.first_rank}, "
                     f"expected {expected})")
            expected += m.nproc
        nodes = [m.node for m in self.members]
        _require(len(set(nodes)) == len(nodes), "members", nodes, "distinct node ids")
        _require(self.store is None or is_endpoint(self.store), "store", self.store,
                 "HOST:PORT")
        _require(isinstance(self.planned, bool), "planned", self.planned, "true or false")
        _require(set(self.joined) <= set(nodes), "joined", list(self.joined),
                 "members of this generation")
        _require(not self.joined or self.planned or self.lost, "joined", list(self.joined),
                 "none unless planned is true (a join) or nodes are lost (spares replace them)")

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(m.node for m in self.members)

    def member(self, node: str) -> Member | None:
        return next((m for m in self.members if m.node == node), None)

    def rank_of(self, node: str, local_rank: int) -> int | None:
        """The global rank of ``node``'s ``local_rank`` worker, or None if it is not a member."""
        m = self.member(node)
        if m is None or not 0 <= local_rank < m.nproc:
            return None
        return m.first_rank + local_rank

    def node_at(self, rank: int) -> str:
        """The node whose worker holds global ``rank`` (``rank_of``'s inverse)."""
        return next(m.node for m in self.members if m.first_rank <= rank < m.first_rank + m.nproc)

    @property
    def joined_ranks(self) -> frozenset[int]:
        """The global ranks of the members new in this generation: they hold no state of
        the job's, so no member takes one from them (``trainer.recover.hand_over``)."""
        return frozenset(r for m in self.members if m.node in self.joined
                         for r in range(m.first_rank, m.first_rank + m.nproc))

    @property
    def store_prefix(self) -> str:
        """The key prefix this generation's group forms under (one per generation)."""
        return self.id.store_prefix

    def to_json(self) -> str:
        return json.dumps({
            "format": FORMAT, "generation": self.id.as_dict(),
            "members": [{"node": m.node, "first_rank": m.first_rank, "nproc": m.nproc}
                        for m in self.members],
            "store": self.store, "lost": list(self.lost), "cause": self.cause,
            "created": self.created, "planned": self.planned, "joined": list(self.joined),
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> GenerationRecord:
        """Parse and validate; ``GenerationRecordError`` names what is wrong."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise GenerationRecordError(f"generation record is not JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise GenerationRecordError(
                f"generation record must be an object with format={FORMAT}; got "
                f"{str(raw)[:120]!r}")
        members = raw.get("members")
        lost = raw.get("lost", [])
        joined = raw.get("joined", [])
        _require(isinstance(members, list) and all(isinstance(m, dict) for m in members),
                 "members", members, "a list of {node, first_rank, nproc} objects")
        _require(isinstance(lost, list) and all(isinstance(n, str) for n in lost), "lost", lost,
                 "a list of node ids")
        _require(isinstance(joined, list) and all(isinstance(n, str) for n in joined), "joined",
                 joined, "a list of node ids")
        _require(isinstance(raw.get("cause", ""), str), "cause", raw.get("cause"), "a string")
        created = raw.get("created", 0.0)
        _require(isinstance(created, (int, float)) and not isinstance(created, bool), "created",
                 created, "a number")
        return cls(
            id=GenerationId.from_dict(raw.get("generation")),
            members=tuple(Member(m.get("node"), m.get("first_rank"), m.get("nproc"))
                          for m in members),
            store=raw.get("store"), lost=tuple(lost), cause=raw.get("cause", ""),
            created=float(created), planned=raw.get("planned", False), joined=tuple(joined),
        )


def renumber(nodes: Iterable[tuple[str, int]]) -> tuple[Member, ...]:
    """Members with contiguous ranks for ``(node, nproc)`` pairs, in the given order."""
    members, first = [], 0
    for node, nproc in nodes:
        members.append(Member(node, first, nproc))
        first += nproc
    return tuple(members)


def shrink(base: GenerationRecord, lost: Iterable[str], stores: Mapping[str, str],
           cause: str = "", created: float = 0.0,
           spares: Iterable[tuple[str, int]] = ()) -> GenerationRecord | None:
    """The next generation of ``base`` without the ``lost`` nodes, or None if there is none.

    Survivors keep their order, so the lowest surviving rank becomes rank 0 (the old
    rank 0 stays rank 0 whenever it survives). The group forms through the store of
    the new rank 0's daemon (``stores``: node -> HOST:PORT); without one, or without
    survivors, there is no in-place generation and the caller takes the restart path.
    ``spares`` (``(node, nproc)``, warm newcomers not in ``base``) follow the survivors,
    joined in the same re-form: the world keeps its size (and its LR).
    """
    gone = set(lost) & set(base.nodes)
    survivors = [(m.node, m.nproc) for m in base.members if m.node not in gone]
    if not gone or not survivors or stores.get(survivors[0][0]) is None:
        return None
    taken = [(n, p) for n, p in spares if base.member(n) is None]
    return GenerationRecord(base.id.next(), renumber(survivors + taken), stores[survivors[0][0]],
                            tuple(sorted(gone)), cause, created, joined=tuple(n for n, _ in taken))


def grow(base: GenerationRecord, joiners: Iterable[tuple[str, int]], store: str | None = None,
         cause: str = "join", created: float = 0.0) -> GenerationRecord:
    """The next generation of ``base`` with ``joiners`` (``(node, nproc)`` pairs) after its
    members: a planned change, so the members keep their ranks and rank 0 stays rank 0;
    the group forms through ``store`` (rank 0's daemon's; default: ``base``'s)."""
    joiners = list(joiners)
    new = [(n, p) for n, p in joiners if base.member(n) is None]
    _require(bool(new), "joined", [n for n, _ in joiners], "at least one node not yet a member")
    members = renumber([(m.node, m.nproc) for m in base.members] + new)
    return GenerationRecord(base.id.next(), members, store or base.store, (), cause, created,
                            planned=True, joined=tuple(n for n, _ in new))


def drain(base: GenerationRecord, leavers: Iterable[str], stores: Mapping[str, str],
          created: float = 0.0) -> GenerationRecord | None:
    """The next generation of ``base`` without the draining ``leavers``: ``shrink``'s, but
    planned (the leavers stop after the step the world agrees, the others re-form then)."""
    record = shrink(base, leavers, stores, "drain", created)
    return None if record is None else replace(record, planned=True)


@dataclass(frozen=True)
class WorldView:
    """What one node's record says of its workers' world (published by its daemon)."""

    node: str
    generation: GenerationId
    first_rank: int
    nproc: int
    world_size: int

    def to_record(self) -> dict[str, Any]:
        """The ``world`` field of the node's etcd record (the node id is the key's)."""
        return {"generation": self.generation.as_dict(), "first_rank": self.first_rank,
                "nproc": self.nproc, "world_size": self.world_size}

    @classmethod
    def from_record(cls, node: str, raw: Any) -> WorldView:
        """Parse a record's ``world`` field; ``GenerationRecordError`` names what is wrong."""
        _require(isinstance(raw, Mapping), "world", raw, "an object")
        first, nproc, size = raw.get("first_rank"), raw.get("nproc"), raw.get("world_size")
        _require(_is_count(first), "world first_rank", first, "an integer >= 0")
        _require(_is_count(nproc) and nproc >= 1, "world nproc", nproc, "an integer >= 1")
        _require(_is_count(size) and size >= first + nproc, "world world_size", size,
                 "an integer >= first_rank + nproc")
        return cls(node, GenerationId.from_dict(raw.get("generation")), first, nproc, size)


@dataclass(frozen=True)
class Entering:
    """What a newcomer's record says while its workers wait to enter a live world in place
    (published by its daemon, ``supervisor.joining``): the world they were started for,
    whether they are warm yet and how many there are. Another newcomer proposing a join
    to the same world takes the warm ones into its generation (several joiners, one
    re-form) and waits a little for those not warm yet."""

    node: str
    live: GenerationId
    warm: bool
    nproc: int

    def to_record(self) -> dict[str, Any]:
        """The ``entering`` field of the node's etcd record."""
        return {"generation": self.live.as_dict(), "warm": self.warm, "nproc": self.nproc}

    @classmethod
    def from_record(cls, node: str, raw: Any) -> Entering:
        """Parse a record's ``entering`` field; ``GenerationRecordError`` names what is wrong."""
        _require(isinstance(raw, Mapping), "entering", raw, "an object")
        warm, nproc = raw.get("warm"), raw.get("nproc")
        _require(isinstance(warm, bool), "entering warm", warm, "true or false")
        _require(_is_count(nproc) and nproc >= 1, "entering nproc", nproc, "an integer >= 1")
        return cls(node, GenerationId.from_dict(raw.get("generation")), warm, nproc)


def current_world(views: Iterable[WorldView]) -> GenerationRecord | None:
    """The record of the newest generation the nodes report, if their reports cover it.

    Every rank ``0 .. world_size - 1`` of that generation must be reported exactly once
    (a node that has not reported yet, or two nodes claiming one rank, leave no record:
    the caller then takes the restart path rather than guess the membership).
    """
    views = list(views)
    if not views:
        return None
    newest = max(views, key=lambda v: (v.generation.round, v.generation.seq)).generation
    mine = sorted((v for v in views if v.generation == newest), key=lambda v: v.first_rank)
    try:
        record = GenerationRecord(newest, tuple(Member(v.node, v.first_rank, v.nproc)
                                                for v in mine))
    except GenerationRecordError:
        return None
    if any(v.world_size != record.world_size for v in mine):
        return None
    return record


def base_of(agreed: GenerationRecord | None, views: Iterable[WorldView],
            workers: GenerationId) -> GenerationRecord | None:
    """What the next generation after ``workers`` is made from: the agreed record when it
    is of our workers' round and not older, else the world the nodes' records report, if
    they cover ``workers``' world; None when neither does (no in-place change then)."""
    if agreed is not None and agreed.id.same_round(workers) and agreed.id.seq >= workers.seq:
        return agreed
    base = current_world(v for v in views if v.generation.same_round(workers))
    return base if base is not None and base.id == workers else None


def read_file(path: str) -> GenerationRecord | None:
    """The record in the local generation file, or None when there is none (yet)."""
    try:
        with open(path, "rb") as f:
            return GenerationRecord.from_json(f.read())
    except FileNotFoundError:
        return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_endpoint(text: Any) -> bool:
    """``text`` is ``HOST:PORT`` (a port 1-65535)."""
    if not isinstance(text, str) or ":" not in text:
        return False
    host, _, port = text.rpartition(":")
    return host != "" and port.isdigit() and 0 < int(port) < 65536


def _require(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise GenerationRecordError(f"generation record field {name}={value!r} is invalid: "
                                    f"expected {expected}")
