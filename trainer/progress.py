"""Progress reports: the ``ELASTICD_PROGRESS_FILE`` JSON and the matching structlog lines.

Local rank 0 of each node atomically rewrites the progress file (temp file +
rename, no fsync: it is a status, not a record) after every event, and after steps
at most every ``FILE_INTERVAL_S`` (always the first step after another event); the daemon reads
it for status and crash-loop detection, the benchmarks to time recovery (the
``time`` of the first ``step`` after a ``resumed``). The same record is logged as a
structlog line every ``log_every`` steps and on every other event.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import structlog

from elasticd.contract.files import write_atomic
from elasticd.contract.progress import EVENTS, WORKING
from trainer.context import ElasticContext

log = structlog.get_logger(__name__)

# A status, not a record (the log lines are the record): its readers (the daemon's
# status and crash-loop check, the benchmarks' recovery clocks) need a few rewrites a
# second and the first step after each event, not a rewrite per step.
FILE_INTERVAL_S = 0.25


class ProgressReporter:
    """Writes progress records for this worker; a no-op on ranks other than local rank 0."""

    def __init__(
        self,
        ctx: ElasticContext,
        log_every: int = 10,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
        file_interval_s: float = FILE_INTERVAL_S,
    ) -> None:
        self.ctx = ctx
        self.enabled = ctx.is_local_rank0
        self.path = ctx.progress_file if self.enabled else None
        self.log_every = max(1, log_every)
        self._wall = wall_clock
        self._clock = clock
        self._rate_mark: tuple[float, int] | None = None
        self.steps_per_s = 0.0
        self.file_interval_s = file_interval_s
        # The generation in the record is the daemon's base for an in-place re-form: only a
        # loop that can re-form in place publishes it (others are restarted instead).
        self.publish_generation = True
        self._last_file: tuple[str, float] | None = None  # (event, when) of the last rewrite

    def record(self, event: str, step: int, **fields: Any) -> dict[str, Any]:
        """The progress record of ``event`` at ``step`` (the contract's keys first)."""
        return {
            "event": event,
            "step": step,
            "world_size": self.ctx.world_size,
            "rank": self.ctx.rank,
            "lr": fields.pop("lr", None),
            "loss": fields.pop("loss", None),
            "time": self._wall(),
            "restart_count": self.ctx.restart_count,
            "run_id": self.ctx.run_id,
            "steps_per_s": round(self.steps_per_s, 3),
            "local_world_size": self.ctx.local_world_size,
            **self._generation(),
            **fields,
        }

    def _generation(self) -> dict[str, Any]:
        # The daemon publishes this (with rank and local_world_size) as its node's part of
        # the world: the base from which the daemons agree on an in-place re-form.
        gen = self.ctx.generation_id
        return {} if gen is None or not self.publish_generation else {"generation": gen.as_dict()}

    def due(self, event: str, step: int) -> bool:
        """Whether ``report(event, step)`` would write the file or log a line: a caller may
        skip building the fields of a step that does neither (most steps)."""
        return self.enabled and (self._line_due(event, step) or (
            self.path is not None and self._file_due(event, self._clock())))

    def report(self, event: str, step: int, **fields: Any) -> None:
        """Rewrite the progress file when due; log unless it is a ``step`` between log points."""
        if event not in EVENTS:
            raise ValueError(f"unknown progress event {event!r}; use one of {EVENTS}")
        if not self.enabled:
            return
        now = self._clock()
        write = self.path is not None and self._file_due(event, now)
        line = self._line_due(event, step)
        if event in WORKING and (write or line):
            self._update_rate(step)  # from the steps between two calls: any call will do
        if not (write or line):
            return
        rec = self.record(event, step, **fields)
        if write:
            self._last_file = (event, now)
            write_atomic(self.path, json.dumps(rec))
        if line:
            # structlog's message key is "event" too: the line's event is the progress event.
            fields = {k: v for k, v in rec.items() if k != "event"}
            log.info(event, kind="progress", **fields)

    def _line_due(self, event: str, step: int) -> bool:
        return event != "step" or step % self.log_every == 0

    def _file_due(self, event: str, now: float) -> bool:
        """Every event but ``step`` is written; steps at most every ``file_interval_s``, and
        always the first step after another event (the step that ends a recovery)."""
        last = self._last_file
        return not (event == "step" and last is not None and last[0] == "step"
                    and now - last[1] < self.file_interval_s)

    def _update_rate(self, step: int) -> None:
        now = self._clock()
        if self._rate_mark is not None:
            then, then_step = self._rate_mark
            if step - then_step >= self.log_every and now > then:
                self.steps_per_s = (step - then_step) / (now - then)
                self._rate_mark = (now, step)
            return
        self._rate_mark = (now, step)
