"""Retention and cleanup: which checkpoints and leftovers to delete, and deleting them.

Deciding is pure (plan_retention, is_stale) and unit-tested without files; acting is
best-effort: a failed deletion is logged and the rest goes on, because retention must
never stop training.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import structlog

# One liveness test for the project: a zombie writer is dead, its temps are leftovers.
from elasticd.contract.pids import pid_alive

from . import _hooks, layout
from .errors import CorruptCheckpointError, StorageError
from .reader import read_manifest, step_dirs_newest_first
from .storage import Storage

log = structlog.get_logger(__name__)


def plan_retention(
    committed: Collection[int], keep_last: int, protect: Collection[int] = ()
) -> list[int]:
    """Committed steps to delete: all but the newest `keep_last` and those in `protect`."""
    kept = set(sorted(committed, reverse=True)[:keep_last]) | set(protect)
    return sorted(step for step in committed if step not in kept)


@dataclass(frozen=True)
class StalePolicy:
    """When a temp or unreferenced data file is a leftover that may be deleted.

    A file whose writer is this process, or a dead process on this host, is a leftover
    (the manager calls cleanup only when it has no write in flight). Files of a live process,
    of another host (a shared mount) or without an owner tag are left to age out after
    `max_age` seconds without modification: a live writer keeps touching its file.
    """

    max_age: float
    me: layout.Owner
    alive: Callable[[int], bool] = pid_alive

    def is_stale(self, name: str, mtime: float, now: float) -> bool:
        if now - mtime > self.max_age:
            return True
        owner = layout.parse_owner(name)
        if owner is None or owner.host != self.me.host:
            return False
        return owner.pid == self.me.pid or not self.alive(owner.pid)


class Cleaner:
    """Deletes old checkpoints and leftovers of crashed writers in one storage."""

    def __init__(self, storage: Storage, policy: StalePolicy, clock=time.time) -> None:
        self._storage = storage
        self._policy = policy
        self._clock = clock

    def run(self, keep_last: int, protect: Collection[int] = ()) -> None:
        """Apply retention and remove stale leftovers; logs failures, never raises them."""
        try:
            self._retain(keep_last, protect)
            self.remove_leftovers()
        except StorageError as exc:
            log.warning("retention_failed", path=exc.path, error=str(exc))

    def _retain(self, keep_last: int, protect: Collection[int]) -> None:
        committed, damaged = self._classify()
        doomed = plan_retention(committed, keep_last, protect)
        oldest_kept = min((s for s in committed if s not in doomed), default=None)
        for step in doomed:
            self.delete_checkpoint(step)
        for step in damaged:
            if oldest_kept is not None and step < oldest_kept:
                self.delete_checkpoint(step)

    def _classify(self) -> tuple[list[int], list[int]]:
        """Steps with a valid manifest, and steps whose manifest exists but is damaged."""
        committed, damaged = [], []
        for step, directory in step_dirs_newest_first(self._storage):
            try:
                read_manifest(self._storage, directory, step)
                committed.append(step)
            except CorruptCheckpointError as exc:
                if layout.MANIFEST_NAME in self._storage.listdir(directory):
                    damaged.append(step)
                    log.warning("checkpoint_damaged", path=exc.path, reason=exc.reason)
        return committed, damaged

    def delete_checkpoint(self, step: int) -> None:
        """Uncommit first (manifest), then delete the files: a crash halfway leaves an
        uncommitted directory, which is ignored and cleaned, never a corrupt checkpoint."""
        directory = layout.step_dir(step)
        try:
            self._storage.remove(f"{directory}/{layout.MANIFEST_NAME}")
            self._storage.sync_dir(directory)
            _hooks.phase("retention.uncommitted", directory)
            for name in self._storage.listdir(directory):
                self._storage.remove(f"{directory}/{name}")
            self._storage.remove_dir(directory)
            self._storage.sync_dir()
            log.info("checkpoint_deleted", step=step, path=self._storage.describe(directory))
        except StorageError as exc:
            log.warning("checkpoint_delete_failed", step=step, path=exc.path, error=str(exc))

    def remove_leftovers(self) -> None:
        """Remove stale temps, unreferenced data files and empty uncommitted directories."""
        self._remove_stale("", self._storage.listdir(), referenced=set())
        for step, directory in step_dirs_newest_first(self._storage):
            referenced = self._referenced(directory, step)
            names = self._storage.listdir(directory)
            if referenced is None and layout.MANIFEST_NAME in names:
                continue  # a damaged manifest: keep the evidence; retention ages it out
            self._remove_stale(directory, names, referenced or set())
            if referenced is None:
                self._remove_if_empty(directory)

    def _referenced(self, directory: str, step: int) -> set[str] | None:
        try:
            manifest = read_manifest(self._storage, directory, step)
        except CorruptCheckpointError:
            return None
        return {layout.MANIFEST_NAME, *manifest.files}

    def _remove_stale(self, directory: str, names: list[str], referenced: set[str]) -> None:
        now = self._clock()
        for name in names:
            owned = layout.is_temp(name) or layout.parse_owner(name) is not None
            if name in referenced or not owned:
                continue
            path = f"{directory}/{name}" if directory else name
            try:
                if self._policy.is_stale(name, self._storage.mtime(path), now):
                    self._storage.remove(path)
                    log.info("leftover_removed", path=self._storage.describe(path))
            except StorageError as exc:
                log.warning("leftover_not_removed", path=exc.path, error=str(exc))

    def _remove_if_empty(self, directory: str) -> None:
        if self._storage.listdir(directory):
            return
        try:
            self._storage.remove_dir(directory)
        except StorageError as exc:
            log.warning("leftover_not_removed", path=exc.path, error=str(exc))
