"""The agreement on the next in-place generation (``elasticd.contract.generation``).

``shrink_world``: the next generation without the lost nodes, agreed by one
compare-and-set on ``JobKeys.generation``. Every survivor (each daemon, or each
companion under plain torchrun) detects the same loss and tries; the first write wins
and the others adopt it, so all of them hand the same record to their workers.
``ShrinkOutcome`` says which.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import structlog

from elasticd.contract.generation import (
    GenerationId,
    GenerationRecord,
    GenerationRecordError,
    WorldView,
    current_world,
    shrink,
)
from elasticd.etcd_client import EtcdClient, KeyValue, no_retry
from elasticd.rendezvous.keys import JobKeys

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ShrinkOutcome:
    """What one agreement did (``shrink_world``).

    ``status``: ``ok`` (a record naming us is agreed: hand it to our workers),
    ``fenced`` (the agreed record leaves us out), ``unneeded`` (the lost nodes were not
    in our workers' world), ``failed`` (no in-place generation: ``reason`` says why).
    ``wrote``: this node's compare-and-set made the record.
    """

    lost: tuple[str, ...]
    status: str
    record: GenerationRecord | None = None
    reason: str = ""
    wrote: bool = False


def shrink_world(client: EtcdClient, keys: JobKeys, node_id: str, lost: Iterable[str],
                 cause: str, workers: GenerationId, views: Iterable[WorldView],
                 stores: Mapping[str, str], deadline_s: float = 1.0) -> ShrinkOutcome:
    """Agree the generation after ``workers`` (our workers' generation) without ``lost``.

    The base is the agreed record when it is of our workers' round and not older, else
    the world the nodes' records report (ours, the peers', the dead peers' last ones).
    A lost compare-and-set re-reads: a winner that already leaves the lost nodes out
    is adopted, anything else is the next base. ``deadline_s`` bounds the races (every
    call fails fast: an outage raises ``EtcdError`` for the caller's fallback).
    """
    lost = tuple(sorted(set(lost)))
    views = [v for v in views if v.generation.same_round(workers)]
    end = time.monotonic() + deadline_s
    with no_retry():
        while True:
            kv = client.get(keys.generation)
            agreed = _parse(kv)
            if (agreed is not None and agreed.id.same_round(workers)
                    and agreed.id.seq >= workers.seq):
                base = agreed
            else:
                base = current_world(views)
                if base is None or base.id != workers:
                    return ShrinkOutcome(lost, "failed", reason=(
                        f"the nodes' records do not cover generation {workers}'s world"))
            if base.id.newer_than(workers) and not set(lost) & set(base.nodes):
                return _adopt(node_id, lost, base, wrote=False)   # another daemon was first
            nxt = shrink(base, lost, stores, cause, created=time.time())
            if nxt is None:
                return _no_generation(lost, base, stores)
            won, _ = client.put_or_create(keys.generation, nxt.to_json().encode(),
                                          kv.mod_revision if kv is not None else None)
            if won:   # the caller's log line names it (the daemon's cycle, the companion's)
                return _adopt(node_id, lost, nxt, wrote=True)
            if time.monotonic() >= end:
                return ShrinkOutcome(lost, "failed", reason="lost the compare-and-set until "
                                                             "the deadline")


def _adopt(node_id: str, lost: tuple[str, ...], record: GenerationRecord,
           wrote: bool) -> ShrinkOutcome:
    status = "ok" if record.member(node_id) is not None else "fenced"
    return ShrinkOutcome(lost, status, record, wrote=wrote)


def _no_generation(lost: tuple[str, ...], base: GenerationRecord,
                   stores: Mapping[str, str]) -> ShrinkOutcome:
    if not set(lost) & set(base.nodes):
        return ShrinkOutcome(lost, "unneeded", base)
    survivors = [n for n in base.nodes if n not in lost]
    reason = (f"no survivor's daemon publishes a store ({survivors[0]})" if survivors
              and survivors[0] not in stores else "no survivors")
    return ShrinkOutcome(lost, "failed", base, reason=reason)


def _parse(kv: KeyValue | None) -> GenerationRecord | None:
    if kv is None:
        return None
    try:
        return GenerationRecord.from_json(kv.value)
    except GenerationRecordError as exc:
        # Replaced by the compare-and-set on its revision.
        log.warning("ignoring a malformed generation record", key=kv.key, problem=str(exc))
        return None
