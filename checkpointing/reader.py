"""Find, verify and load committed checkpoints. Reading never modifies the storage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import digest, layout
from .errors import CorruptCheckpointError, StorageError, StorageNotFoundError
from .manifest import MAX_MANIFEST_BYTES, Manifest
from .storage import Storage

_CHUNK = 16 << 20


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A verified checkpoint: its step, the saved state (tensors on map_location), manifest."""

    step: int
    state: Any
    manifest: Manifest
    location: str


def step_dirs_newest_first(storage: Storage) -> list[tuple[int, str]]:
    """(step, directory) of every step directory, committed or not, newest first."""
    found = []
    for name in storage.listdir():
        step = layout.parse_step_dir(name)
        if step is not None and storage.is_dir(name):
            found.append((step, name))
    return sorted(found, reverse=True)


def read_manifest(storage: Storage, directory: str, step: int) -> Manifest:
    """The manifest of `directory` (cheap: sizes only, no hashing) or CorruptCheckpointError.

    A missing manifest means the save never committed; it is reported as
    CorruptCheckpointError too so that callers can name it when they skip it.
    """
    path = f"{directory}/{layout.MANIFEST_NAME}"
    where = storage.describe(path)
    try:
        with storage.open_read(path) as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except StorageNotFoundError as exc:
        raise CorruptCheckpointError(where, "no manifest: the save never committed") from exc
    except StorageError as exc:
        raise CorruptCheckpointError(where, f"manifest unreadable: {exc}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(where, f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
    manifest = Manifest.from_json(data, where)
    if manifest.step != step:
        raise CorruptCheckpointError(
            where, f"manifest says step {manifest.step} in the directory of step {step}"
        )
    for name, entry in manifest.files.items():
        _check_size(storage, f"{directory}/{name}", entry.bytes)
    return manifest


def _check_size(storage: Storage, path: str, expected: int) -> None:
    where = storage.describe(path)
    try:
        actual = storage.size(path)
    except StorageNotFoundError as exc:
        raise CorruptCheckpointError(where, "listed in the manifest but missing") from exc
    except StorageError as exc:
        raise CorruptCheckpointError(where, f"unreadable: {exc}") from exc
    if actual != expected:
        state = "truncated" if actual < expected else "longer than recorded"
        raise CorruptCheckpointError(where, f"{state}: {actual} bytes, manifest says {expected}")


def verify_files(storage: Storage, directory: str, manifest: Manifest) -> None:
    """Recompute every file's digest; CorruptCheckpointError names the first mismatch."""
    for name, entry in manifest.files.items():
        path = f"{directory}/{name}"
        where = storage.describe(path)
        hasher, size = digest.new(entry.algorithm), 0
        try:
            with storage.open_read(path) as f:
                while chunk := f.read(_CHUNK):
                    hasher.update(chunk)
                    size += len(chunk)
        except StorageError as exc:
            raise CorruptCheckpointError(where, f"unreadable: {exc}") from exc
        if size != entry.bytes:
            raise CorruptCheckpointError(where, f"size changed to {size} bytes while verifying")
        if hasher.hexdigest() != entry.digest:
            raise CorruptCheckpointError(
                where, f"{entry.algorithm} mismatch: the file content is damaged")


def load_state(storage: Storage, directory: str, manifest: Manifest, map_location: Any) -> Any:
    """torch.load with weights_only=True: tensors and plain containers, never arbitrary code.

    A local file is memory-mapped: verification has just read it into the page cache, so
    this costs no second read and no copy (CPU tensors are private, copy-on-write views of
    the file; committed files are never modified, and a deleted one stays mapped).
    """
    where = storage.describe(directory)
    if len(manifest.files) != 1:  # format version 1 writes exactly one data file
        raise CorruptCheckpointError(where, f"{len(manifest.files)} data files, expected 1")
    (name,) = manifest.files
    path = f"{directory}/{name}"
    where = storage.describe(path)
    local = storage.local_path(path)
    try:
        if local is not None:
            return torch.load(local, map_location=map_location, weights_only=True, mmap=True)
        with storage.open_read(path) as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except Exception as exc:
        # The bytes verified against the manifest, so this is a forged or foreign file (its
        # digest was recomputed): whatever torch raises for it (UnpicklingError, RuntimeError,
        # KeyError, zipfile errors, ...) makes the checkpoint damaged, not the caller crash.
        raise CorruptCheckpointError(
            where, f"torch.load failed: {type(exc).__name__}: {exc}") from exc


def load_verified(
    storage: Storage, directory: str, step: int, map_location: Any
) -> LoadedCheckpoint:
    """Read, verify and load one checkpoint, or raise CorruptCheckpointError."""
    manifest = read_manifest(storage, directory, step)
    verify_files(storage, directory, manifest)
    state = load_state(storage, directory, manifest, map_location)
    return LoadedCheckpoint(step, state, manifest, storage.describe(directory))
