"""The one writer of the workers' generation file (``ELASTICD_GENERATION_FILE``).

An agreed record reaches the workers only through here, from whichever path agreed or
adopted it: the daemon's SHRINK and its backstop (WRITE_GENERATION), and the companion
under plain torchrun. The workers poll the file (``generation.read_file``, from
``trainer.reform``) and re-form once it names a generation newer than theirs.
"""

from __future__ import annotations

from elasticd.contract.files import write_atomic
from elasticd.contract.generation import GenerationRecord


def hand_over(path: str, record: GenerationRecord) -> None:
    """Replace the workers' file atomically (a reader sees the old or the new record);
    raises ``OSError`` when it cannot (the workers then never see this generation)."""
    write_atomic(path, record.to_json())
