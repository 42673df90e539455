"""Atomic, verified, asynchronous rank-0 checkpoints (see docs/checkpointing.md)."""

from .errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StaleGenerationError,
    StorageConflictError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
    UnsupportedStateError,
)
from .manager import CheckpointManager
from .manifest import FileEntry, Manifest
from .object_storage import ObjectStorage, open_storage
from .reader import LoadedCheckpoint
from .storage import AtomicWrite, LocalStorage, Storage

__all__ = [
    "AtomicWrite",
    "CheckpointConfigError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "FileEntry",
    "LoadedCheckpoint",
    "LocalStorage",
    "Manifest",
    "ObjectStorage",
    "StaleGenerationError",
    "Storage",
    "StorageError",
    "StorageFullError",
    "StorageConflictError",
    "StorageNotFoundError",
    "StoragePermissionError",
    "UnsupportedStateError",
    "open_storage",
]
