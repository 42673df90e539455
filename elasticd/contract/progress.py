"""The workers' progress record: its event names and its schema, as the trainer writes it
(``trainer/progress.py``) and the daemon and the torchrun companion read it.

The file is a status, one JSON object replaced atomically: the last ``event`` and, with it,
the step, the world, the generation and the node's first rank; a re-form's details on a
``reformed`` / ``reform-failed`` event (``Reform``). A record that does not parse is
ignored whole (``parse_progress``: None), a garbled generation only leaves the world
unknown. Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from elasticd.contract.generation import GenerationId, GenerationRecordError, WorldView

log = structlog.get_logger(__name__)

# Every event a progress record may carry. "warm": a newcomer (ELASTICD_JOINING=1) is
# ready (imports, model, device) and waits to be admitted by a generation that names its
# node among the joined.
EVENTS = ("step", "resumed", "checkpoint", "stopped", "completed", "reformed", "reform-failed",
          "diverged", "unfit", "peer-unfit", "warm")
# The events of a group that is training.
WORKING = ("step", "checkpoint")
# The events with a re-form's details.
REFORM_EVENTS = ("reformed", "reform-failed")
# The events whose step is not the job's: a newcomer that holds no state yet says step 0.
# Whoever reads the job's history from progress records (the benchmarks' goodput, a
# timeline) skips them, or a join in place looks like a rollback to step 0.
NO_HISTORY = ("warm",)
# The events after which the node's workers are no longer in their group.
FINISHED = ("completed", "stopped", "reform-failed")


@dataclass(frozen=True)
class Reform:
    """A ``reformed`` / ``reform-failed`` progress record's details (None: not given)."""

    event: str
    duration_s: float | None = None
    from_world_size: int | None = None
    cause: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Progress:
    """The workers' last progress record (``trainer/progress.py`` writes it)."""

    step: int | None = None
    world_size: int | None = None
    event: str | None = None
    restart_count: int | None = None
    rank: int | None = None          # the global rank of the node's local rank 0
    generation: GenerationId | None = None   # the workers' generation (absent: plain torchrun)
    local_world_size: int | None = None
    reform: Reform | None = None     # the details of a reformed / reform-failed event
    reason: str | None = None        # why, for an event that says (unfit, peer-unfit, ...)

    def world(self, node: str) -> WorldView | None:
        """What this node publishes of its workers' world (``world`` in its record); none
        while they are warm newcomers (their ranks are their own world's, not the job's)."""
        if (self.generation is None or self.event == "warm"
                or None in (self.rank, self.local_world_size, self.world_size)):
            return None
        try:
            return WorldView.from_record(node, {
                "generation": self.generation.as_dict(), "first_rank": self.rank,
                "nproc": self.local_world_size, "world_size": self.world_size})
        except GenerationRecordError:
            return None


def parse_progress(raw: Any) -> Progress | None:
    if not isinstance(raw, dict):
        return None
    step, world, event, restarts, rank, local = (raw.get(k) for k in (
        "step", "world_size", "event", "restart_count", "rank", "local_world_size"))
    if not all(v is None or type(v) is int for v in (step, world, restarts, rank, local)):
        return None
    if event is not None and not isinstance(event, str):
        return None
    generation = _generation(raw.get("generation"))
    reform = _reform(event, raw) if event in REFORM_EVENTS else None
    reason = raw.get("reason") if isinstance(raw.get("reason"), str) else None
    return Progress(step, world, event, restarts, rank, generation, local, reform, reason)


def _generation(raw: Any) -> GenerationId | None:
    # A garbled generation leaves the world unknown (the restart path), not the record.
    if raw is None:
        return None
    try:
        return GenerationId.from_dict(raw)
    except GenerationRecordError:
        return None


def _reform(event: str, raw: dict[str, Any]) -> Reform:
    def typed(name: str, kind: type | tuple[type, ...]) -> Any:
        value = raw.get(name)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    duration = typed("duration_s", (int, float))
    return Reform(event, None if duration is None else float(duration),
                  typed("from_world_size", int), typed("cause", str), typed("reason", str))


class ProgressReader:
    """Re-reads the progress file when its mtime changes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._mtime: float | None = None
        self.progress = Progress()

    def read(self) -> Progress:
        try:
            mtime = self._path.stat().st_mtime
        except OSError:
            return self.progress
        if mtime == self._mtime:
            return self.progress
        try:
            parsed = parse_progress(json.loads(self._path.read_text()))
        except (OSError, ValueError):
            return self.progress  # caught mid-replace; the next cycle reads it
        self._mtime = mtime
        if parsed is None:
            log.warning("ignoring a malformed progress record", file=str(self._path))
            return self.progress
        self.progress = parsed
        return parsed
