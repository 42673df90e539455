"""CheckpointManager: the public entry point (rank 0 saves; every rank may load).

Threading model: save/wait/load are called from one thread (the training loop). One
background job at a time runs the write of an asynchronous save, then retention; a
blocking save writes in the caller's thread and runs only retention in the background.
A new save, wait() and close() first join the previous job and raise its error, if any.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog
import torch

# The one keep_last rule, shared with the daemon config and the worker contract.
from elasticd.contract.settings import KEEP_LAST_WHY, MIN_KEEP_LAST, is_valid_keep_last

from . import layout
from .errors import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StaleGenerationError,
)
from .fence import Generation, raise_fence
from .manifest import validate_metadata
from .object_storage import open_storage
from .reader import LoadedCheckpoint, load_verified, read_manifest, step_dirs_newest_first
from .retention import Cleaner, StalePolicy
from .snapshot import Snapshotter, host_view
from .storage import Storage
from .writer import WriteReport, write_checkpoint

log = structlog.get_logger(__name__)


def _default_world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class _Job:
    """One background task; remembers its exception for the training thread to raise."""

    def __init__(self, name: str, work: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self._work = work
        # Not a daemon: interpreter exit waits for an in-flight write instead of dropping it.
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # handed to the training thread by join()
            self.error = exc
            # Logged now as well: a program that never calls save() or wait() again
            # must still not lose the error silently.
            log.error("checkpoint_background_failed", job=self._thread.name, error=str(exc))

    def join(self) -> BaseException | None:
        self._thread.join()
        return self.error

    def running(self) -> bool:
        return self._thread.is_alive()


class CheckpointManager:
    """Atomic, verified, optionally asynchronous checkpoints in one directory.

    Single writer: one manager in one process (rank 0) saves into a directory at a time;
    any number of processes may load from it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int = 3,
        *,
        storage: Storage | None = None,
        world_size: int | None = None,
        pin_memory: bool | None = None,
        stale_temp_seconds: float = 3600.0,
        read_only: bool = False,
        generation: int | None = None,
        generation_epoch: str | None = None,
        generation_seq: int = 0,
    ) -> None:
        """Open (creating if needed) `directory` and remove leftovers of crashed writers.

        keep_last: committed checkpoints to keep (>= 2). world_size: recorded in manifests
        (default: torch.distributed's, else $WORLD_SIZE, else 1). pin_memory: pinned
        snapshot buffers (default: when CUDA is available). stale_temp_seconds: age after
        which an unmodified temp file of a live or remote writer counts as abandoned.
        `directory` is a path, or a bucket URL (``s3://bucket/prefix``, ``gs://...``:
        ``object_storage.ObjectStorage``, credentials from the environment or the
        instance role). `storage` replaces either (then `directory` is only a label).
        read_only: for ranks that only load: no write probe, no cleanup, save() refused.
        generation, generation_epoch: the writer's world (ELASTICD_GENERATION and
        ELASTICD_GENERATION_EPOCH, set by the etcd3 rendezvous plugin). A writer with a
        generation raises the directory's fence to it here and every commit is refused
        (StaleGenerationError) once a newer world has raised it further; see fence.py.
        None: no fence is read or written (plain torchrun). Ignored when read_only.
        generation_seq: the in-place re-forms of that round (0: the world torchrun formed).
        Raises CheckpointConfigError for bad values, StorageError if not writable,
        StaleGenerationError if the fence is already above `generation`.
        """
        _check_config(keep_last, stale_temp_seconds)
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise CheckpointConfigError(
                f"world_size={world_size!r} must be an int >= 1, or None to take it from "
                "torch.distributed or $WORLD_SIZE"
            )
        self.keep_last = keep_last
        self.directory = os.fspath(directory)
        self.storage: Storage = storage if storage is not None else open_storage(directory)
        self._world_size = world_size
        self._snapshotter = Snapshotter(pin_memory)
        self._job: _Job | None = None
        self._lock = threading.Lock()
        # The newest committed write's figures (bytes, seconds, CPU, hash, commit/upload
        # time and MB/s), also in its checkpoint_committed log line; the stall benchmark
        # reads them here.
        self.last_write: WriteReport | None = None
        self.read_only = read_only
        try:
            self.generation = None if generation is None or read_only else Generation(
                generation, generation_epoch, generation_seq)
        except ValueError as exc:
            raise CheckpointConfigError(str(exc)) from None
        policy = StalePolicy(max_age=stale_temp_seconds, me=layout.Owner.current())
        self._cleaner = Cleaner(self.storage, policy)
        if not read_only:
            self.storage.check_writable()
            self._cleaner.remove_leftovers()
            if self.generation is not None:
                raise_fence(self.storage, self.generation)

    # -- saving -----------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        blocking: bool = True,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Save `state` as checkpoint `step`.

        blocking=True returns once the checkpoint is committed (durable, checksummed).
        blocking=False returns once the state is copied to host memory; the write runs in
        the background. At most one write is in flight: a save first waits for the previous
        one. An error of a background write is raised by the next save() or wait() (this
        save is then not taken: call it again). `metadata` (JSON values) goes into the
        manifest. Saving a step that exists replaces it atomically.
        """
        _check_step(step)
        if self.read_only:
            raise CheckpointConfigError(
                f"save(step={step}) on a read_only manager of {self.directory}; only the "
                "writer (rank 0) saves: create its manager without read_only=True"
            )
        meta = validate_metadata(metadata)
        with self._lock:
            self._finish_job(raise_error=True)
            world_size = self._world_size or _default_world_size()
            if blocking:
                self._write(step, host_view(state), world_size, meta)
                self._start_job(f"checkpoint-retention-{step}", lambda: self._retain(step))
                return
            tree = self._snapshotter.snapshot(state)
            self._start_job(f"checkpoint-write-{step}", lambda: self._write_and_retain(
                step, tree, world_size, meta))

    def advance_generation(self, seq: int) -> None:
        """This writer's process now belongs to re-form ``seq`` of its round: raise the fence.

        Its in-flight save, if any, commits under the new generation: the state it holds is
        a step of this same lineage. StaleGenerationError if a newer world already owns the
        directory.
        """
        if self.generation is None:
            return
        with self._lock:
            self.generation = Generation(self.generation.number, self.generation.epoch, seq)
            raise_fence(self.storage, self.generation)

    @property
    def writing(self) -> bool:
        """True while a background save (its write or its retention) is still running."""
        job = self._job
        return job is not None and job.running()

    def wait(self) -> None:
        """Block until the in-flight save is committed; raise its error if it failed."""
        with self._lock:
            self._finish_job(raise_error=True)

    def close(self) -> None:
        """wait(), then release the snapshot buffers."""
        self.wait()
        self._snapshotter.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is on its way out: do not replace it with a write error
            self.close()
        except CheckpointError as exc:
            log.error("checkpoint_failed_during_exit", error=str(exc))

    def _write(self, step: int, tree: Any, world_size: int, meta: dict[str, Any]) -> None:
        try:
            report = write_checkpoint(
                self.storage, step, tree, world_size=world_size, metadata=meta,
                generation=lambda: self.generation,
            )
        except StaleGenerationError as exc:
            log.error("checkpoint_refused_stale_generation", step=step,
                      generation=str(exc.generation), fence=str(exc.fence))
            raise
        self.last_write = report
        log.info("checkpoint_committed", step=step,
                 path=self.storage.describe(layout.step_dir(step)), **report.as_log())

    def _write_and_retain(self, step: int, tree: Any, world_size: int, meta: dict) -> None:
        self._write(step, tree, world_size, meta)
        self._retain(step)

    def _retain(self, step: int) -> None:
        self._cleaner.run(self.keep_last, protect=(step,))

    def _start_job(self, name: str, work: Callable[[], None]) -> None:
        self._job = _Job(name, work)

    def _finish_job(self, *, raise_error: bool) -> None:
        job = self._job
        if job is None:
            return
        error = job.join()
        if error is not None and not raise_error:
            return  # stays pending for the next save() or wait()
        self._job = None
        if error is not None:
            error.add_note("(raised by the background save of an earlier call)")
            raise error

    # -- loading ----------------------------------------------------------------------

    def load_latest(self, map_location: Any = "cpu") -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, or None if there is none.

        A damaged, truncated or uncommitted newer checkpoint is skipped with a warning that
        names the file and the reason. Waits for an in-flight save first.
        """
        self._join_quietly()
        for step, directory in step_dirs_newest_first(self.storage):
            try:
                return load_verified(self.storage, directory, step, map_location)
            except CorruptCheckpointError as exc:
                log.warning("checkpoint_skipped", step=step, path=exc.path, reason=exc.reason)
        return None

    def load(self, step: int, map_location: Any = "cpu") -> LoadedCheckpoint:
        """Checkpoint `step`, verified; CheckpointNotFoundError or CorruptCheckpointError."""
        _check_step(step)
        self._join_quietly()
        directory = layout.step_dir(step)
        if not self.storage.is_dir(directory):
            raise CheckpointNotFoundError(f"no checkpoint of step {step} in {self.directory}")
        return load_verified(self.storage, directory, step, map_location)

    def latest_step(self) -> int | None:
        """Step of the newest committed checkpoint (manifest valid, file sizes right),
        without loading or hashing tensors; load_latest() may still fall back past it if
        its content turns out damaged."""
        steps = self.steps()
        return steps[-1] if steps else None

    def steps(self) -> list[int]:
        """Steps of all committed checkpoints (cheap check, as latest_step), oldest first."""
        self._join_quietly()
        found = []
        for step, directory in step_dirs_newest_first(self.storage):
            try:
                read_manifest(self.storage, directory, step)
            except CorruptCheckpointError:
                continue
            found.append(step)
        return sorted(found)

    def _join_quietly(self) -> None:
        with self._lock:
            self._finish_job(raise_error=False)


def _check_config(keep_last: int, stale_temp_seconds: float) -> None:
    if not is_valid_keep_last(keep_last):
        raise CheckpointConfigError(
            f"keep_last={keep_last!r}: keep_last must be >= {MIN_KEEP_LAST} {KEEP_LAST_WHY}; "
            f"set keep_last={MIN_KEEP_LAST} or more"
        )
    if not stale_temp_seconds > 0:
        raise CheckpointConfigError(
            f"stale_temp_seconds={stale_temp_seconds!r} must be > 0; it should exceed the time "
            "one save takes (the default is 3600)"
        )


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointConfigError(
            f"step={step!r}: the step must be an int >= 0 (the training step or sample count)"
        )
