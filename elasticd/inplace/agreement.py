"""The agreement on the next in-place generation (``elasticd.contract.generation``).

``shrink_world``: the next generation without the lost nodes, agreed by one
compare-and-set on ``JobKeys.generation``. Every survivor (each daemon, or each
companion under plain torchrun) detects the same loss and tries; the first write wins
and the others adopt it, so all of them hand the same record to their workers.
``drain_world``: the planned generation without a draining node, agreed by its own
daemon through the same compare-and-set loop (``_agree``); the others adopt the record
they read. ``grow_world``: the planned generation with a joining node (a join in place),
agreed by the newcomer's own daemon once its workers are warm, through the same loop.
``ShrinkOutcome`` says what each did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from elasticd.contract import generation
from elasticd.contract.generation import (
    GenerationId,
    GenerationRecord,
    GenerationRecordError,
    WorldView,
    base_of,
    shrink,
)
from elasticd.etcd_client import EtcdClient, KeyValue, no_retry
from elasticd.inplace.vetting import Roster, refusal
from elasticd.rendezvous.keys import JobKeys

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ShrinkOutcome:
    """What one agreement did (``shrink_world``).

    ``status``: ``ok`` (a record naming us is agreed: hand it to our workers; for
    ``drain_world``, a planned record without us), ``fenced`` (the agreed record leaves
    us out), ``unneeded`` (the lost nodes were not in our workers' world), ``failed`` (no
    in-place generation: ``reason`` says why).
    ``wrote``: this node's compare-and-set made the record.
    """

    lost: tuple[str, ...]
    status: str
    record: GenerationRecord | None = None
    reason: str = ""
    wrote: bool = False


def shrink_world(client: EtcdClient, keys: JobKeys, node_id: str, lost: Iterable[str],
                 cause: str, workers: GenerationId, views: Iterable[WorldView],
                 roster: Roster, deadline_s: float = 1.0,
                 spares: Iterable[tuple[str, int]] = ()) -> ShrinkOutcome:
    """Agree the generation after ``workers`` (our workers' generation) without ``lost``,
    and with the warm ``spares`` (``(node, nproc)``) in their places.

    The base is the agreed record when it is of our workers' round and not older, else
    the world the nodes' records report (ours, the peers', the dead peers' last ones).
    A lost compare-and-set re-reads: a winner that already leaves the lost nodes out
    is adopted, anything else is the next base; a newer record that the nodes' own
    records (``roster``: theirs as this reader saw them, ours included) do not bear out
    is neither (``vetting``): no in-place change then. ``deadline_s`` bounds the races
    (every call fails fast: an outage raises ``EtcdError`` for the caller's fallback).
    """
    lost, spares = tuple(sorted(set(lost))), tuple(spares)
    stores = roster.stores
    out = _agree(client, keys, workers, views, roster, deadline_s,
                 make=lambda base: shrink(base, lost, stores, cause, created=time.time(),
                                          spares=spares),
                 settled=lambda base: not set(lost) & set(base.nodes))
    if isinstance(out, str):
        return ShrinkOutcome(lost, "failed", reason=out)
    if out.how == NO_NEXT:
        return _no_generation(lost, out.record, stores)
    return _adopt(node_id, lost, out.record, wrote=out.how == WROTE)


def drain_world(client: EtcdClient, keys: JobKeys, node_id: str, workers: GenerationId,
                views: Iterable[WorldView], roster: Roster,
                deadline_s: float = 1.0) -> ShrinkOutcome:
    """Agree the planned generation after ``workers`` without this draining node.

    ``status`` ``ok``: the agreed record leaves ``node_id`` out (ours, or another writer's
    that already does): hand it to our workers, who stop after the step the world agrees
    while the others re-form. ``failed``: no drain in place (another change of our
    workers' world is already agreed, no survivor, no store; ``reason``): the caller
    drains by the restart path. Same bounds as ``shrink_world``.
    """
    me, stores = (node_id,), roster.stores
    out = _agree(client, keys, workers, views, roster, deadline_s,
                 # Only from our workers' own world: a change of it agreed first is theirs
                 # to take before anyone can leave it.
                 make=lambda base: (generation.drain(base, me, stores, created=time.time())
                                    if base.id == workers else None),
                 settled=lambda base: node_id not in base.nodes)
    if isinstance(out, str):
        return ShrinkOutcome(me, "failed", reason=out)
    if out.how == NO_NEXT:
        return ShrinkOutcome(me, "failed", out.record, reason=(
            "another change of our workers' world is agreed" if out.record.id != workers
            else _no_survivor(me, out.record, stores)))
    return ShrinkOutcome(me, "ok", out.record, wrote=out.how == WROTE)


def grow_world(client: EtcdClient, keys: JobKeys, node_id: str, nproc: int, live: GenerationId,
               views: Iterable[WorldView], roster: Roster,
               deadline_s: float = 1.0, others: Mapping[str, int] | None = None) -> ShrinkOutcome:
    """Agree the planned generation after ``live`` (the members' world, which this node's
    warm newcomers wait to enter) with this node and its ``nproc`` workers after the
    members (they keep their ranks), and with ``others`` (node: nproc, other nodes' warm
    newcomers of ``live``) not in it yet: the joiners in node order. The group forms
    through the store of rank 0's daemon.

    ``status`` ``ok``: the agreed record names this node among the joined (ours, or
    another writer's that already does): hand it to our workers. ``failed``: no join in
    place (the world changed first, its rank 0 publishes no store; ``reason``): the
    caller takes the restart path. Same bounds as ``shrink_world``.
    """
    me = (node_id,)

    def make(base: GenerationRecord) -> GenerationRecord | None:
        # Only from the world our newcomers were started for: a change of it agreed
        # first (a loss, another join) is the members' to take before ours.
        store = roster.stores.get(base.members[0].node)
        if base.id != live or store is None:
            return None
        joiners = sorted({**(others or {}), node_id: nproc}.items())   # grow skips members
        return generation.grow(base, joiners, store, created=time.time())

    out = _agree(client, keys, live, views, roster, deadline_s, make=make,
                 settled=lambda base: node_id in base.joined)
    if isinstance(out, str):
        return ShrinkOutcome(me, "failed", reason=out)
    if out.how == NO_NEXT:
        base = out.record
        return ShrinkOutcome(me, "failed", base, reason=(
            f"the world changed first (generation {base.id}, not {live})" if base.id != live
            else f"rank 0's daemon ({base.members[0].node}) publishes no store"))
    return ShrinkOutcome(me, "ok", out.record, wrote=out.how == WROTE)


# How ``_agree`` ended: another writer's record already settles it; ours won the
# compare-and-set; the base has no next generation (``make`` gave None).
ADOPTED, WROTE, NO_NEXT = "adopted", "wrote", "no-next"


@dataclass(frozen=True)
class _Agreed:
    record: GenerationRecord
    how: str


def _agree(client: EtcdClient, keys: JobKeys, workers: GenerationId, views: Iterable[WorldView],
           roster: Roster, deadline_s: float,
           make: Callable[[GenerationRecord], GenerationRecord | None],
           settled: Callable[[GenerationRecord], bool]) -> _Agreed | str:
    """The one compare-and-set loop every agreement runs: the record newer than ``workers``
    that ``settled`` accepts, once agreed (another writer's: ``ADOPTED``; ours: ``WROTE``),
    the base when ``make`` has no next generation of it (``NO_NEXT``), or why neither
    (text; among them a newer record that ``roster`` does not bear out: it is not
    overwritten, for it may be a true one this reader's view lags behind)."""
    views = list(views)
    end = time.monotonic() + deadline_s
    with no_retry():
        while True:
            kv = client.get(keys.generation)
            agreed = _parse(kv)
            if agreed is not None and agreed.id.newer_than(workers):
                why = refusal(agreed, roster)
                if why is not None:
                    return f"the agreed generation {agreed.id} is refused: {why}"
            base = base_of(agreed, views, workers)
            if base is None:
                return f"the nodes' records do not cover generation {workers}'s world"
            if base.id.newer_than(workers) and settled(base):
                return _Agreed(base, ADOPTED)   # another daemon was first
            nxt = make(base)
            if nxt is None:
                return _Agreed(base, NO_NEXT)
            won, _ = client.put_or_create(keys.generation, nxt.to_json().encode(),
                                          kv.mod_revision if kv is not None else None)
            if won:   # the caller's log line names it (the daemon's cycle, the companion's)
                return _Agreed(nxt, WROTE)
            if time.monotonic() >= end:
                return "lost the compare-and-set until the deadline"


def _adopt(node_id: str, lost: tuple[str, ...], record: GenerationRecord,
           wrote: bool) -> ShrinkOutcome:
    status = "ok" if record.member(node_id) is not None else "fenced"
    return ShrinkOutcome(lost, status, record, wrote=wrote)


def _no_generation(lost: tuple[str, ...], base: GenerationRecord,
                   stores: Mapping[str, str]) -> ShrinkOutcome:
    if not set(lost) & set(base.nodes):
        return ShrinkOutcome(lost, "unneeded", base)
    return ShrinkOutcome(lost, "failed", base, reason=_no_survivor(lost, base, stores))


def _no_survivor(lost: tuple[str, ...], base: GenerationRecord, stores: Mapping[str, str]) -> str:
    """Why ``base`` has no next generation without ``lost`` (``generation.shrink``'s None)."""
    survivors = [n for n in base.nodes if n not in lost]
    return (f"no survivor's daemon publishes a store ({survivors[0]})" if survivors
            and survivors[0] not in stores else "no survivors")


def _parse(kv: KeyValue | None) -> GenerationRecord | None:
    if kv is None:
        return None
    try:
        return GenerationRecord.from_json(kv.value)
    except GenerationRecordError as exc:
        # Replaced by the compare-and-set on its revision.
        log.warning("ignoring a malformed generation record", key=kv.key, problem=str(exc))
        return None
