"""Storage interface and its local-directory implementation.

Everything above this module sees relative, '/'-separated paths and CheckpointError
subclasses; OSError never crosses this boundary. A local disk and a shared POSIX mount
(NFS) both use LocalStorage; an object store can implement the same Protocol.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable

import structlog

from . import _hooks, layout
from .errors import (
    StorageConflictError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
)

log = structlog.get_logger(__name__)

_FULL = {errno_mod.ENOSPC, errno_mod.EDQUOT}
_DENIED = {errno_mod.EACCES, errno_mod.EPERM, errno_mod.EROFS, errno_mod.ENOTDIR}
# Some filesystems cannot fsync a directory; their rename is then as durable as it gets.
_DIR_FSYNC_UNSUPPORTED = {errno_mod.EINVAL, errno_mod.ENOTSUP, errno_mod.EBADF}


def _not_regular(where: str, mode: int) -> StorageError:
    return StorageError(f"{where} is not a regular file ({stat.filemode(mode)}); checkpoints "
                        "only consist of regular files, so this one is refused", path=where)


def translate_os_error(exc: OSError, action: str, path: str) -> StorageError:
    """The StorageError subclass for `exc`, with a message that says what to do."""
    reason = exc.strerror or str(exc)
    if exc.errno in _FULL:
        return StorageFullError(
            f"{action} {path}: {reason}; free space on the checkpoint storage (a save needs "
            "room for one more checkpoint than keep_last); committed checkpoints are intact",
            path=path, errno=exc.errno,
        )
    if exc.errno in _DENIED:
        return StoragePermissionError(
            f"{action} {path}: {reason}; make the checkpoint directory a writable directory "
            "or choose another one",
            path=path, errno=exc.errno,
        )
    if exc.errno == errno_mod.ENOENT:
        return StorageNotFoundError(f"{action} {path}: {reason}", path=path, errno=exc.errno)
    return StorageError(f"{action} {path}: {reason}", path=path, errno=exc.errno)


@contextlib.contextmanager
def _translated(action: str, path: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise translate_os_error(exc, action, path) from exc


@dataclass(frozen=True)
class Expect:
    """What a conditional write's target must hold when it commits: ``version`` None for
    nothing (create only), else the token ``Storage.version`` returned for it earlier."""

    version: str | None


def conflict(where: str, expect: Expect) -> StorageConflictError:
    """The error of a conditional commit whose target changed (one wording for both stores)."""
    found = "an object appeared" if expect.version is None else "the object was replaced"
    return StorageConflictError(
        f"committing {where}: {found} since this write began (another writer committed "
        "there); this write is not taken and the other one is left as it is", path=where)


class AtomicWrite(Protocol):
    """A file being written under a temporary name; invisible under its final name until commit."""

    def write(self, data: bytes | memoryview) -> int:
        """Append `data`; returns len(data)."""
        ...

    def commit(self) -> None:
        """Make the content durable, then atomically publish it under the final name."""
        ...

    def abort(self) -> None:
        """Discard the temporary file; a no-op after commit or a previous abort."""
        ...


@runtime_checkable
class Storage(Protocol):
    """Where checkpoints live. Paths are relative to the storage root, '/'-separated.

    Contract:
    - `open_write(path)` returns an AtomicWrite. Until `commit()` returns, `path` shows its
      previous content (or does not exist); after it returns, `path` has the new content
      durably (file data and the name both survive a power cut). Temporary objects it
      creates are named with `layout.TEMP_PREFIX` in the same directory, so cleanup can find
      them. Leaving the writer without commit (an exception) discards it.
    - `open_write(path, expect)`: commit raises StorageConflictError, publishing nothing,
      unless `path` still holds what `expect` says (nothing, or the `version(path)` token
      taken earlier). A bucket decides this in the put itself (S3's If-None-Match/If-Match);
      a directory creates with link(2), which fails if the name exists, and replaces after
      comparing the token (rename(2) cannot compare: a replace that races is narrowed to
      the instant between the check and the rename, not closed).
    - `remove` and `remove_dir` are idempotent: a missing object is not an error.
      `remove_dir` removes an empty directory only.
    - `make_dir` is idempotent and durable (the new name survives a crash).
    - `listdir` of a missing directory is empty.
    - `open_read`, `size` and `mtime` refuse anything but a regular file (a FIFO, a device,
      a symlink) with a StorageError, at once: a forged checkpoint must never hang a reader.
    - Every failure is a StorageError subclass: StorageFullError for no space,
      StoragePermissionError for refused writes, StorageNotFoundError for missing objects.
    - Single writer: one process writes a given root at a time. Readers may run at any time.
    """

    def describe(self, path: str = "") -> str:
        """A human-readable location of `path` (for logs and error messages)."""
        ...

    def local_path(self, path: str) -> str | None:
        """A filesystem path of `path` that may be memory-mapped, or None (then readers use
        open_read). Files are never modified after commit, so a mapping stays valid."""
        ...

    def check_writable(self) -> None:
        """Create the root if needed and prove a write works, or raise StorageError."""
        ...

    def listdir(self, path: str = "") -> list[str]: ...

    def is_dir(self, path: str) -> bool: ...

    def make_dir(self, path: str) -> None: ...

    def open_write(self, path: str, expect: Expect | None = None) -> AtomicWrite: ...

    def version(self, path: str) -> str | None:
        """An opaque token of the object now at `path` (None: there is none)."""
        ...

    def open_read(self, path: str) -> BinaryIO: ...

    def size(self, path: str) -> int: ...

    def mtime(self, path: str) -> float: ...

    def remove(self, path: str) -> None: ...

    def remove_dir(self, path: str) -> None: ...

    def sync_dir(self, path: str = "") -> None:
        """Make the names in directory `path` durable (after removals)."""
        ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


_WRITE_BEHIND_BYTES = 64 << 20
# link(2) unsupported here (EPERM: some FUSE mounts; EXDEV cannot happen in one directory).
_NO_LINKS = {errno_mod.EPERM, errno_mod.ENOTSUP, errno_mod.EOPNOTSUPP, errno_mod.ENOSYS,
             errno_mod.EMLINK}


def _version(path: Path) -> str | None:
    """Inode, modification time and size of the entry at `path` (None: none): a rename
    into place always changes the inode."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


def _drop_cached_pages(fd: int) -> None:
    """Evict a file's clean pages from the page cache and start writeback of dirty ones.

    Checkpoints are read back only on restart, and growing the cache by GBs per save costs
    the writer more CPU than hashing (page allocation: measured 2.7 s of system time for
    1.2 GB when the cache grows, 0.3 s when its pages are recycled), besides the memory.
    Called every _WRITE_BEHIND_BYTES while writing, it keeps the file's cache footprint to
    a few windows (pages written back by the previous call are clean by the next one).
    """
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class _LocalAtomicWrite:
    """Temp file in the target's directory -> write -> fsync -> rename -> fsync directory."""

    def __init__(self, final: Path, label: str, expect: Expect | None = None) -> None:
        self._final = final
        self._label = label
        self._expect = expect
        self._temp = final.parent / layout.temp_name()
        with _translated("create", self._label):
            self._file = open(self._temp, "xb", buffering=0)  # noqa: SIM115 - closed in commit/abort
        self._done = False
        self._size = self._dropped_at = 0
        _hooks.phase("write.opened", label)

    def write(self, data: bytes | memoryview) -> int:
        with _translated("write", self._label):
            view = memoryview(data)
            while view:  # unbuffered writes may be short
                written = self._file.write(view)
                view = view[written:]
        self._size += len(data)
        if self._size - self._dropped_at >= _WRITE_BEHIND_BYTES:
            _drop_cached_pages(self._file.fileno())
            self._dropped_at = self._size
        _hooks.phase("write.data", self._label)
        return len(data)

    def commit(self) -> None:
        if self._done:
            return
        try:
            with _translated("commit", self._label):
                os.fsync(self._file.fileno())
                _drop_cached_pages(self._file.fileno())
                self._file.close()
                _hooks.phase("write.fsynced", self._label)
                self._publish()
                self._done = True
                _hooks.phase("write.renamed", self._label)
                _fsync_dir(self._final.parent)
        finally:
            if not self._done:
                self.abort()

    def _publish(self) -> None:
        """Rename into place, or for a conditional write, publish only as ``expect`` says."""
        expect = self._expect
        if expect is not None and expect.version is None and self._link_exclusively():
            return
        if expect is not None and _version(self._final) != expect.version:
            raise conflict(self._label, expect)
        os.replace(self._temp, self._final)

    def _link_exclusively(self) -> bool:
        """Create the final name as a hard link of the temp file: link(2) fails if the name
        exists, so this is a create-only commit. False where the filesystem has no links
        (some FUSE mounts): the caller then checks and renames."""
        try:
            os.link(self._temp, self._final)
        except FileExistsError:
            raise conflict(self._label, self._expect or Expect(None)) from None
        except OSError as exc:
            if exc.errno in _NO_LINKS:
                return False
            raise
        self._temp.unlink()
        return True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self._file.close()
        try:
            self._temp.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("temp_file_not_removed", path=str(self._temp), error=str(exc))

    def __enter__(self) -> _LocalAtomicWrite:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()


class LocalStorage:
    """A directory on a local disk or a POSIX shared mount (NFS: rename and fsync are atomic
    and durable there when the mount is `sync` or the client honours fsync, as NFSv3/v4 do)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def describe(self, path: str = "") -> str:
        return str(self._p(path))

    def local_path(self, path: str) -> str | None:
        return str(self._p(path))

    def check_writable(self) -> None:
        where = self.describe()
        with _translated("create checkpoint directory", where):
            if self.root.exists() and not self.root.is_dir():
                raise NotADirectoryError(errno_mod.ENOTDIR, "exists and is not a directory")
            self.root.mkdir(parents=True, exist_ok=True)
        probe = self.root / (layout.temp_name() + ".probe")
        with _translated("write a probe file in", where):
            probe.write_bytes(b"")
            probe.unlink()

    def listdir(self, path: str = "") -> list[str]:
        try:
            with _translated("list", self.describe(path)):
                return sorted(os.listdir(self._p(path)))
        except StorageNotFoundError:
            return []

    def is_dir(self, path: str) -> bool:
        return self._p(path).is_dir()

    def make_dir(self, path: str) -> None:
        target = self._p(path)
        with _translated("create directory", str(target)):
            if target.is_dir():
                return
            target.mkdir(exist_ok=True)
            _fsync_dir(target.parent)

    def open_write(self, path: str, expect: Expect | None = None) -> _LocalAtomicWrite:
        return _LocalAtomicWrite(self._p(path), self.describe(path), expect)

    def version(self, path: str) -> str | None:
        with _translated("stat", self.describe(path)):
            return _version(self._p(path))

    def open_read(self, path: str) -> BinaryIO:
        # Only regular files are read. A FIFO would block open() and read() forever, a
        # device could be endless, a symlink could point anywhere: O_NONBLOCK makes open()
        # return at once whatever the file is, O_NOFOLLOW refuses a symlink (ELOOP), and
        # the fstat of the opened descriptor (no race with a rename) decides.
        where = self.describe(path)
        with _translated("open", where):
            fd = os.open(self._p(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with _translated("open", where):
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):
                    raise _not_regular(where, mode)
                os.set_blocking(fd, True)  # a regular file ignores it; keep reads plain
                return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def size(self, path: str) -> int:
        return self._lstat_regular(path).st_size

    def mtime(self, path: str) -> float:
        return self._lstat_regular(path).st_mtime

    def _lstat_regular(self, path: str) -> os.stat_result:
        # lstat: the entry itself, never what a symlink points at (see open_read).
        where = self.describe(path)
        with _translated("stat", where):
            st = os.lstat(self._p(path))
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(where, st.st_mode)
        return st

    def remove(self, path: str) -> None:
        with _translated("remove", self.describe(path)):
            self._p(path).unlink(missing_ok=True)

    def remove_dir(self, path: str) -> None:
        with _translated("remove directory", self.describe(path)), contextlib.suppress(
            FileNotFoundError
        ):
            self._p(path).rmdir()

    def sync_dir(self, path: str = "") -> None:
        with _translated("sync directory", self.describe(path)):
            _fsync_dir(self._p(path))
