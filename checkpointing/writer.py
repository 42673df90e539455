"""Write one checkpoint: data file(s) first, then the manifest that commits them.

Runs in the background writer thread for asynchronous saves, so it hashes while writing
(one pass over the bytes) instead of re-reading the file. Each write reports where its time
went (``WriteReport``): on CPU-bound training the writer's CPU time is the stall.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import pickle
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _hooks, digest, layout
from .errors import CheckpointError, CorruptCheckpointError, StorageError
from .fence import Generation, check_fence
from .manifest import FileEntry, Manifest
from .reader import read_manifest
from .storage import AtomicWrite, Expect, Storage


class _HashingSink:
    """The file-like object torch.save writes to: counts, hashes, forwards to storage,
    and sums the seconds spent hashing and writing.

    It remembers the first storage error because torch.save's cleanup writes again after a
    failure, and that second error must not hide the first (ENOSPC says what to do).
    """

    def __init__(self, out: AtomicWrite, clock: Callable[[], float] = time.perf_counter) -> None:
        self._out = out
        self._hasher = digest.new()
        self._clock = clock
        self.nbytes = 0
        self.hash_s = 0.0
        self.write_s = 0.0
        self.error: StorageError | None = None

    def write(self, data: bytes | memoryview) -> int:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        started = self._clock()
        self._hasher.update(view)  # both hashes release the GIL for large buffers
        hashed = self._clock()
        try:
            self._out.write(view)
        except StorageError as exc:
            self.error = exc
            raise
        finally:
            self.hash_s += hashed - started
            self.write_s += self._clock() - hashed
        self.nbytes += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing buffered here; durability comes from commit()."""

    def entry(self) -> FileEntry:
        return FileEntry(self.nbytes, self._hasher.hexdigest(), digest.WRITE_ALGORITHM)


@dataclass
class WriteReport:
    """A committed checkpoint and where its write's time went (seconds).

    ``hash_s`` and ``write_s`` are inside ``serialize_s`` (torch's writer calls the sink);
    ``commit_s`` is the data file's commit: fsync + rename on a directory, the upload on a
    bucket. ``cpu_s`` is the CPU time of the writing thread over the whole write: what
    CPU-bound training pays for an asynchronous save.
    """

    manifest: Manifest
    bytes: int
    seconds: float
    cpu_s: float
    serialize_s: float
    hash_s: float
    write_s: float
    commit_s: float

    def as_log(self) -> dict[str, float | int]:
        """The figures for the ``checkpoint_committed`` log line; MB/s of the commit."""
        return {"bytes": self.bytes, "seconds": round(self.seconds, 3),
                "cpu_s": round(self.cpu_s, 3), "serialize_s": round(self.serialize_s, 3),
                "hash_s": round(self.hash_s, 3), "write_s": round(self.write_s, 3),
                "commit_s": round(self.commit_s, 3),
                "commit_mb_per_s": round(self.bytes / 1e6 / max(self.commit_s, 1e-6), 1)}


@functools.cache
def _crc_free_save_available() -> bool:
    """Whether torch's private zip writer API has the shape serialize() relies on."""
    try:
        params = list(inspect.signature(torch.serialization._save).parameters)
        torch._C.PyTorchFileWriter(_NullSink(), False, 64)
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return False
    return params == ["obj", "zip_file", "pickle_module", "pickle_protocol",
                      "_disable_byteorder_record"]


class _NullSink:
    def write(self, data: bytes | memoryview) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def serialize(tree: Any, sink: Any) -> None:
    """torch.save(tree, sink) without the zip CRC32 of every record, when torch allows.

    The manifest's digest already covers every byte, and the CRC costs the background
    writer ~0.2 s of CPU per GB, which CPU-bound training pays for (measured here: async
    stall at 1.2 GB 1.65 s with CRC, ~1.0-1.2 s without). torch's only switch is a
    process-global config, so this drives torch.save's own writer with the flag off; it
    falls back to torch.save if that private API changes. torch.load reads both.
    """
    if not _crc_free_save_available():
        torch.save(tree, sink)
        return
    writer = torch._C.PyTorchFileWriter(sink, False, torch.serialization._get_storage_alignment())
    torch.serialization._save(tree, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _write_data(storage: Storage, path: str, tree: Any) -> tuple[_HashingSink, float, float]:
    """Serialize ``tree`` into ``path`` and commit it: (the sink, serialize s, commit s)."""
    with storage.open_write(path) as out:
        sink = _HashingSink(out)
        started = time.perf_counter()
        try:
            serialize(tree, sink)
        except Exception as exc:
            if sink.error is not None:
                raise sink.error from None
            raise CheckpointError(f"serializing {storage.describe(path)} failed: {exc}") from exc
        serialized = time.perf_counter()
        out.commit()
    return sink, serialized - started, time.perf_counter() - serialized


def write_checkpoint(
    storage: Storage,
    step: int,
    tree: Any,
    *,
    world_size: int,
    metadata: Mapping[str, Any],
    clock: Callable[[], float] = time.time,
    generation: Generation | Callable[[], Generation | None] | None = None,
) -> WriteReport:
    """Write `tree` as checkpoint `step` and commit it; returns the committed manifest and
    where the time went.

    With a `generation`, the directory's fence is checked just before the manifest is
    written and again right after its rename: a newer world's fence makes this raise
    StaleGenerationError, and a manifest renamed while the fence went up is taken back
    (see fence.py). Without one, no fence is read or written. A callable is asked at each
    check: the writer's process may move into a newer generation (an in-place re-form)
    while its background save runs.

    If this raises, the checkpoint may be uncommitted (it then does not exist) but every
    previously committed checkpoint is unchanged: data files always get fresh names and the
    manifest is replaced atomically, so a re-save of a step swaps old for new in one rename.
    The manifest is published only if its name still holds what it held when this write
    began (StorageConflictError otherwise, this write's data file removed): another writer's
    commit of the same step is never overwritten.
    """
    started, cpu_started = time.perf_counter(), time.thread_time()
    directory = layout.step_dir(step)
    manifest_path = f"{directory}/{layout.MANIFEST_NAME}"
    # What the manifest's name holds now: the commit publishes only if that is unchanged,
    # so a writer that committed this step meanwhile is never overwritten (see Storage).
    expect = Expect(storage.version(manifest_path))
    storage.make_dir(directory)
    data = layout.data_name()
    sink, serialize_s, commit_s = _write_data(storage, f"{directory}/{data}", tree)
    entry = sink.entry()
    _hooks.phase("checkpoint.data_committed", directory)
    generation = generation() if callable(generation) else generation
    manifest = Manifest(
        step=step, wall_time=clock(), world_size=world_size,
        files={data: entry}, metadata=dict(metadata),
        generation=None if generation is None else generation.number,
        generation_epoch=None if generation is None else generation.epoch,
    )
    action = f"committing checkpoint step {step}"
    try:
        if generation is not None:
            check_fence(storage, generation, action)
            _hooks.phase("checkpoint.fence_checked", directory)
        with storage.open_write(manifest_path, expect) as out:
            out.write(manifest.to_json())
            out.commit()
    except CheckpointError:
        _discard(storage, f"{directory}/{data}")
        raise
    if generation is not None:
        _recheck_after_commit(storage, directory, step, data, generation, action)
    _hooks.phase("checkpoint.committed", directory)
    return WriteReport(manifest, entry.bytes, time.perf_counter() - started,
                       time.thread_time() - cpu_started, serialize_s, sink.hash_s, sink.write_s,
                       commit_s)


def _recheck_after_commit(storage: Storage, directory: str, step: int, data: str,
                          generation: Generation, action: str) -> None:
    """The fence went up between the check and the rename (this writer was paused there):
    take the manifest back if it is still ours, so no stale checkpoint stays committed."""
    try:
        check_fence(storage, generation, action)
    except CheckpointError:
        manifest_path = f"{directory}/{layout.MANIFEST_NAME}"
        with contextlib.suppress(CheckpointError):
            # Ours if it names our data file (fresh per save); a newer writer's manifest of
            # the same step is left alone.
            try:
                ours = data in read_manifest(storage, directory, step).files
            except CorruptCheckpointError:
                ours = False
            if ours:
                storage.remove(manifest_path)
                storage.sync_dir(directory)
                _discard(storage, f"{directory}/{data}")
        raise


def _discard(storage: Storage, path: str) -> None:
    """Free the space of an uncommitted data file now (disk full is the usual cause)."""
    # If this fails too, the file is a leftover of this process: the next cleanup takes it.
    with contextlib.suppress(StorageError):
        storage.remove(path)
