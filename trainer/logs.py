"""structlog set-up for training scripts (the library itself only logs, never configures)."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(level: str = "info", json_lines: bool | None = None) -> None:
    """Route structlog to stderr: JSON lines unless stderr is a terminal.

    Each line carries the worker's RANK (``worker_rank``) so interleaved worker output stays readable.
    """
    if json_lines is None:
        json_lines = not sys.stderr.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_rank,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write() per line (PrintLogger writes the newline separately): lines of
        # workers sharing one stderr would otherwise interleave mid-line.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _add_rank(_logger, _method, event_dict):
    # A processor rather than bound context: background threads (checkpoint writes) log too.
    # Read per line, not at import: a warm-started worker (elasticd.warmstart) imported this
    # module in the server, before it had a RANK.
    event_dict.setdefault("worker_rank", os.environ.get("RANK", "?"))
    return event_dict
