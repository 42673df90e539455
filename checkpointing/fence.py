"""Generation fence: a worker of an older world can never commit once a newer world exists.

`<directory>/fence.json` holds the generation of the newest world that opened the
directory for writing: ``{"generation": 7, "epoch": "<hex>", "seq": 0}``. A generation is:

* ``number``: torch's rendezvous round of the writer's world (``ELASTICD_GENERATION``);
* ``seq``: the in-place re-forms of that round (``elasticd.contract.generation``; 0 when torchrun
  formed the world; a fence written before re-forms existed reads as 0);
* ``epoch``: an id of the rendezvous state's lifetime (``ELASTICD_GENERATION_EPOCH``). The
  round restarts at 0 whenever the rendezvous state is created afresh (its etcd lease
  expired after a stop, a new etcd, another ``--rdzv-id``), so numbers of two epochs
  cannot be compared: a world of another epoch than the fence's replaces the fence when
  it opens the directory, and a writer whose epoch is not the fence's is refused.

Rules (`raise_fence` when rank 0 opens the directory, `check_fence` at every commit):

* same epoch: the fence only goes up (read, compare, write); a writer whose
  ``(number, seq)`` is below the fence is stale and refused (StaleGenerationError), equal is fine;
* other epoch: opening replaces the fence, committing is refused;
* no fence yet (or a malformed one): opening writes it; a commit check re-creates it.

The fence is written like everything else here: temp, fsync, rename, fsync directory.
Without a generation (plain torchrun, or a hand-made manager) nothing reads or writes it.

Limits, by design of a plain file (no compare-and-set on a POSIX directory): a writer
paused between its check and its manifest's rename is only caught by the re-check after
the rename, which takes its manifest back (`write_checkpoint`); two worlds opening the
directory at the same instant may leave the lower number, which the higher one's next
commit check raises again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import structlog

from .errors import CheckpointError, StaleGenerationError, StorageNotFoundError
from .storage import Storage

log = structlog.get_logger(__name__)

FENCE_NAME = "fence.json"
_MAX_FENCE_BYTES = 4096
_MAX_EPOCH_CHARS = 256


@dataclass(frozen=True)
class Generation:
    """A world's generation: its rendezvous round `number` within rendezvous `epoch`, and
    `seq`, the in-place re-forms of that round (elasticd.contract.generation; 0 for the world
    torchrun formed). Within an epoch, generations are ordered by (number, seq)."""

    number: int
    epoch: str | None = None
    seq: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.number, bool) or not isinstance(self.number, int) or self.number < 0:
            raise ValueError(f"generation={self.number!r} must be an int >= 0 (a rendezvous round)")
        if self.epoch is not None and not (isinstance(self.epoch, str)
                                           and 0 < len(self.epoch) <= _MAX_EPOCH_CHARS):
            raise ValueError(f"generation epoch={self.epoch!r} must be a non-empty str of at most "
                             f"{_MAX_EPOCH_CHARS} characters, or None")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise ValueError(f"generation seq={self.seq!r} must be an int >= 0 (in-place re-forms)")

    @property
    def order(self) -> tuple[int, int]:
        """The position within the epoch: a larger one is a newer world."""
        return (self.number, self.seq)

    def __str__(self) -> str:
        number = f"{self.number}" if self.seq == 0 else f"{self.number}.{self.seq}"
        return number if self.epoch is None else f"{number} (epoch {self.epoch})"

    def to_json(self) -> bytes:
        return json.dumps({"generation": self.number, "epoch": self.epoch,
                           "seq": self.seq}).encode() + b"\n"


class MalformedFence(CheckpointError):
    """fence.json exists but is not a fence (damaged or forged)."""


def read_fence(storage: Storage) -> Generation | None:
    """The directory's fence; None if there is none; MalformedFence if it is not one."""
    where = storage.describe(FENCE_NAME)
    try:
        with storage.open_read(FENCE_NAME) as fh:
            data = fh.read(_MAX_FENCE_BYTES + 1)
    except StorageNotFoundError:
        return None
    if len(data) > _MAX_FENCE_BYTES:
        raise MalformedFence(f"{where} is over {_MAX_FENCE_BYTES} bytes; not a fence")
    try:
        body = json.loads(data)
        return Generation(body["generation"], body.get("epoch"), body.get("seq", 0))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise MalformedFence(f"{where} is not a fence ({exc!r:.200})") from None


def _write_fence(storage: Storage, generation: Generation) -> None:
    with storage.open_write(FENCE_NAME) as out:
        out.write(generation.to_json())
        out.commit()


def _stale(mine: Generation, fence: Generation, action: str) -> StaleGenerationError:
    return StaleGenerationError(
        f"{action} refused: this writer is of generation {mine}, but the checkpoint directory's "
        f"fence is at generation {fence}: a newer world owns the directory and this worker is "
        "stale (evicted or paused); it must exit without committing",
        generation=mine, fence=fence,
    )


def raise_fence(storage: Storage, mine: Generation) -> Generation | None:
    """Open the directory for world `mine`: raise the fence to it (never lower it).

    Returns the fence found before (None if none). Raises StaleGenerationError if the fence
    is already above `mine` in the same epoch: this world is stale from the start.
    """
    try:
        found = read_fence(storage)
    except MalformedFence as exc:
        log.warning("checkpoint_fence_replaced", reason=str(exc))
        found = None
    if found is not None and found.epoch == mine.epoch:
        if found.order > mine.order:
            raise _stale(mine, found, "opening the checkpoint directory")
        if found.order == mine.order:
            return found  # another writer of this world (or a restart of this process)
    if found is not None and found.epoch != mine.epoch:
        log.warning("checkpoint_fence_new_epoch", fence=str(found), generation=str(mine),
                    hint="the rendezvous state was created anew; this world now owns the directory")
    _write_fence(storage, mine)
    log.info("checkpoint_fence_raised", generation=mine.number, seq=mine.seq, epoch=mine.epoch,
             previous=None if found is None else str(found))
    return found


def check_fence(storage: Storage, mine: Generation, action: str) -> None:
    """Before (and after) a commit: refuse unless `mine` is still the directory's newest world.

    A fence below `mine` (same epoch), missing or malformed is (re)raised to `mine`: two
    openings racing can leave the lower number behind, and the directory's owner must
    keep fencing out the older one.
    """
    try:
        found = read_fence(storage)
    except MalformedFence as exc:
        log.warning("checkpoint_fence_replaced", reason=str(exc))
        found = None
    if found is not None and (found.epoch != mine.epoch or found.order > mine.order):
        raise _stale(mine, found, action)
    if found != mine:
        _write_fence(storage, mine)
        log.info("checkpoint_fence_raised", generation=mine.number, seq=mine.seq,
                 epoch=mine.epoch, previous=None if found is None else str(found))
