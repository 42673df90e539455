"""A node that joins a live job in place takes no round: its agent's next rendezvous is its own.

A torchrun agent starts workers only out of a rendezvous, and a new node's join key would
make every member's agent stop its workers for a new round (``num_nodes_waiting``): the
restart a join in place exists to avoid. So a joining node's daemon creates the enter
file (``ELASTICD_ENTER_FILE``) before it starts the agent, holding the live world's
generation (its round and epoch). ``enter_if_asked`` consumes it at the start of the
keyed handler's ``next_rendezvous`` and returns a world of this agent alone, through a
store prefix of its own: torch assigns its workers local ranks, and they start as
newcomers (``ELASTICD_JOINING=1``, the round and epoch exported as every world's are),
warm up, and wait until the daemons agree the generation that names this node among the
joined (``elasticd.inplace.agreement.grow_world``); then they enter the members' group
and take the state from a live peer. The file is read once: the agent's next rendezvous
(after its workers exit, or when a node waits for the next round) is an ordinary one.

The file is data (JSON, two fields, validated): nothing in it is executed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from elasticd.contract.files import write_atomic
from elasticd.contract.generation import GenerationId, GenerationRecordError
from elasticd.contract.settings import ENTER_FILE_ENV, JOINING_ENV

if TYPE_CHECKING:   # the daemon writes the file without torch; only the handler needs it
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousInfo

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Entry:
    """What the enter file says: the live world's generation the newcomer waits to enter."""

    generation: GenerationId

    def to_json(self) -> bytes:
        return json.dumps({"round": self.generation.round,
                           "epoch": self.generation.epoch}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Entry:
        """Parse the file; ``ValueError`` names what is wrong."""
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"the enter file is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("the enter file is not a JSON object")
        try:
            return cls(GenerationId(data.get("round"), 0, data.get("epoch")))
        except GenerationRecordError as exc:
            raise ValueError(f"the enter file's generation is invalid: {exc}") from None


def write_entry(path: Path, generation: GenerationId) -> None:
    """The daemon's side: create the enter file (atomically) before the agent starts."""
    write_atomic(path, Entry(generation).to_json())


def take_entry() -> Entry | None:
    """The enter file's entry, removed as it is read; None when there is none (or it is
    unreadable: one warning, then an ordinary round)."""
    path = os.environ.get(ENTER_FILE_ENV)
    if not path:
        return None
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    finally:
        Path(path).unlink(missing_ok=True)
    try:
        return Entry.from_json(raw)
    except ValueError as exc:
        log.warning("ignoring the enter file; joining an ordinary round", path=path,
                    problem=str(exc))
        return None


def alone(run_id: str, store: Store, agent: str, addr: str, entry: Entry,
          export: Callable[[int, RendezvousInfo], None]) -> RendezvousInfo:
    """The newcomer's own world: rank 0 of 1, under a store prefix no member uses; its
    workers are told to enter the live group (``ELASTICD_JOINING=1``)."""
    from torch.distributed import PrefixStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

    gen = entry.generation
    prefix = f"torch.rendezvous.{run_id}.enter.{gen.round}.{agent}"
    own = PrefixStore(prefix, store)
    info = RendezvousInfo(own, 0, 1, RendezvousStoreInfo.build(0, own, local_addr=addr))
    os.environ[JOINING_ENV] = "1"
    export(gen.round, info)
    log.info("entering the live world in place: this agent's workers start as newcomers",
             round=gen.round, epoch=gen.epoch)
    return info


def ordinary() -> None:
    """Every other world: its workers are members, not newcomers."""
    os.environ.pop(JOINING_ENV, None)


__all__ = ["Entry", "alone", "ordinary", "take_entry", "write_entry"]
