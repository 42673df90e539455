"""What the workers report back about a re-form (their progress file's ``reformed`` and
``reform-failed`` events), as the daemon's policy reads it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reform:
    """A ``reformed`` / ``reform-failed`` progress record's details (None: not given)."""

    event: str
    duration_s: float | None = None
    from_world_size: int | None = None
    cause: str | None = None
    reason: str | None = None
