"""The package's exception hierarchy: everything raised on purpose derives from CheckpointError.

OSError and torch's errors are translated where they enter (storage.py, the torch calls in
writer.py and reader.py), so callers handle one family and messages say what to do.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Root of every error this package raises on purpose."""


class CheckpointConfigError(CheckpointError, ValueError):
    """An argument or configuration value is invalid; the message says how to fix it."""


class UnsupportedStateError(CheckpointError, TypeError):
    """The state holds an object that cannot be saved; the message names its path in the dict."""


class StorageError(CheckpointError):
    """A storage operation failed. `path` is the object concerned, `errno` the OS error number."""

    def __init__(self, message: str, *, path: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class StorageFullError(StorageError):
    """No space left (ENOSPC, EDQUOT). Committed checkpoints are untouched."""


class StoragePermissionError(StorageError):
    """The storage refuses writes (EACCES, EPERM, EROFS) or is not a directory."""


class StorageNotFoundError(StorageError):
    """The object does not exist (ENOENT)."""


class StorageConflictError(StorageError):
    """A conditional commit found another object than it expected under its name (another
    writer committed there meanwhile); what that writer committed is left as it is."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint failed verification: `path` names the file, `reason` says what is wrong."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CheckpointNotFoundError(CheckpointError):
    """The requested checkpoint was never committed (or has been deleted by retention)."""


class StaleGenerationError(CheckpointError):
    """This writer's world is older than the one that owns the directory (its fence).

    A worker of an evicted (e.g. paused, then woken) world must never commit: the save is
    refused before its manifest is published. `generation` is the writer's, `fence` the
    directory's (each an ``(epoch, number)`` pair as described in docs/checkpointing.md).
    """

    def __init__(self, message: str, *, generation: object, fence: object) -> None:
        super().__init__(message)
        self.generation = generation
        self.fence = fence
