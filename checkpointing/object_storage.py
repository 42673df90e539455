"""Checkpoints in object storage (S3, GCS, any fsspec filesystem): the Storage contract on a
bucket, and ``open_storage``, which picks the implementation from the location's form.

An object store has no rename and no directories, but a put is atomic: an object appears
whole or not at all, under its final key. So a write is spooled to a local temporary
file and uploaded whole at ``commit`` (s3fs uploads a large one in parts, which the store
assembles only when the upload completes); nothing of it is visible before, and a writer
killed mid-upload leaves no object (an unfinished multipart upload is invisible; a bucket
lifecycle rule removes it). A "directory" is a key prefix: making one is a no-op, it
exists while an object under it does, and removing it removes nothing. The manifest is
still written last (``writer.py``), so a checkpoint exists only once its manifest does.

Credentials come from the environment or the instance's role, as the fsspec backend
(s3fs/botocore, gcsfs) finds them, never from etcd; ``storage_options`` passes extra
settings through (an endpoint URL, a region), never secrets in the location itself.

Every listing and lookup goes to the store (the backend's listing cache is dropped
first): another node's commit or deletion must be seen at once.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from elasticd.contract.locations import is_url

from . import _hooks
from .errors import StorageError, StorageNotFoundError, StoragePermissionError
from .storage import Expect, LocalStorage, Storage, conflict

_PROBE_PREFIX = ".elasticd-probe-"
# What S3 answers a put whose condition failed: 412, or 409 when a concurrent write of the
# same key was under way (then the other write decides).
_CONDITION_FAILED = {"PreconditionFailed", "ConditionalRequestConflict", "412", "409"}


def open_storage(location: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> Storage:
    """The storage at ``location``: a bucket URL (``ObjectStorage``) or a directory path
    (``LocalStorage``)."""
    if is_url(location):
        return ObjectStorage(os.fspath(location), storage_options)
    return LocalStorage(location)


@contextlib.contextmanager
def _translated(action: str, where: str) -> Iterator[None]:
    """Backend errors as StorageError subclasses, naming the location and the fix."""
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as exc:
        raise StorageNotFoundError(f"{action} {where}: {exc}", path=where) from exc
    except PermissionError as exc:
        raise StoragePermissionError(
            f"{action} {where}: {exc}; give this node's credentials (the environment or the "
            "instance role) read and write access to the bucket and prefix", path=where) from exc
    except Exception as exc:  # noqa: BLE001 - botocore, aiohttp and gcsfs raise their own
        raise StorageError(f"{action} {where}: {type(exc).__name__}: {exc}", path=where) from exc


def _condition_failed(exc: BaseException) -> bool:
    """True if ``exc`` (or what it wraps: s3fs turns botocore's ClientError into OSError)
    is the store refusing a conditional put."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, FileExistsError):   # s3fs's word for a failed If-None-Match
            return True
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
            return code in _CONDITION_FAILED or status in _CONDITION_FAILED
        seen = seen.__cause__ or seen.__context__
    return False


class _ObjectAtomicWrite:
    """Spool to a local temporary file, upload whole at commit (see the module doc)."""

    def __init__(self, storage: ObjectStorage, path: str, expect: Expect | None = None) -> None:
        self._storage = storage
        self._path = path
        self._expect = expect
        self._spool: Any = tempfile.NamedTemporaryFile(prefix="elasticd-upload-")  # noqa: SIM115
        self._done = False
        _hooks.phase("write.opened", path)

    def write(self, data: bytes | memoryview) -> int:
        with _translated("spooling", self._storage.describe(self._path)):
            self._spool.write(data)
        _hooks.phase("write.data", self._path)
        return len(data)

    def commit(self) -> None:
        where = self._storage.describe(self._path)
        try:
            with _translated("uploading", where):
                self._spool.flush()
                _hooks.phase("write.uploading", self._path)   # spooled whole, nothing put yet
                self._upload()
                _hooks.phase("write.uploaded", self._path)
        finally:
            self._close()

    def _upload(self) -> None:
        key = self._storage.key(self._path)
        if self._expect is None:
            self._storage.fs.put_file(self._spool.name, key)
            return
        # A conditional write is a small object (a manifest): one put, the condition
        # checked by the store in that request.
        self._spool.seek(0)
        data = self._spool.read()
        try:
            self._storage.put_if(key, data, self._expect)
        except Exception as exc:
            if _condition_failed(exc):
                raise conflict(self._storage.describe(self._path), self._expect) from exc
            raise

    def abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            with contextlib.suppress(OSError):
                self._spool.close()

    def __enter__(self) -> _ObjectAtomicWrite:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()   # the contract: leaving without commit discards


class ObjectStorage:
    """Checkpoints under ``s3://bucket/prefix`` (or any fsspec URL); see the module doc."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None,
                 fs: Any = None) -> None:
        import fsspec.core

        if fs is None:
            with _translated("opening", url):
                fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        self.url = url.rstrip("/")
        self._root = root.rstrip("/")

    def key(self, path: str = "") -> str:
        """The backend's path of ``path`` (``bucket/prefix/path``)."""
        return f"{self._root}/{path}" if path else self._root

    def describe(self, path: str = "") -> str:
        return f"{self.url}/{path}" if path else self.url

    def local_path(self, path: str) -> str | None:
        return None

    def check_writable(self) -> None:
        """Prove a put, a read back and a delete work under the prefix."""
        probe = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        with _translated("writing a probe object to", self.describe(probe)):
            self.fs.pipe_file(self.key(probe), b"elasticd")
            if self.fs.cat_file(self.key(probe)) != b"elasticd":
                raise StorageError(f"{self.describe(probe)} read back other bytes than written",
                                   path=self.describe(probe))
            self.fs.rm_file(self.key(probe))

    def _fresh(self) -> None:
        self.fs.invalidate_cache()

    def listdir(self, path: str = "") -> list[str]:
        with _translated("listing", self.describe(path)):
            self._fresh()
            try:
                entries = self.fs.ls(self.key(path), detail=False)
            except FileNotFoundError:
                return []
        base = self.key(path).rstrip("/") + "/"
        return sorted({e[len(base):].split("/")[0] for e in entries if e.startswith(base)} - {""})

    def is_dir(self, path: str) -> bool:
        with _translated("looking up", self.describe(path)):
            self._fresh()
            return bool(self.fs.isdir(self.key(path)))

    def make_dir(self, path: str) -> None:
        """A prefix exists while an object under it does: nothing to make."""

    def open_write(self, path: str, expect: Expect | None = None) -> _ObjectAtomicWrite:
        return _ObjectAtomicWrite(self, path, expect)

    def version(self, path: str) -> str | None:
        """The object's ETag (None: no object), what a conditional put names."""
        with _translated("looking up", self.describe(path)):
            self._fresh()
            try:
                info = self.fs.info(self.key(path))
            except FileNotFoundError:
                return None
        tag = info.get("ETag") or info.get("etag")
        return str(tag) if tag else f"{info.get('size')}-{info.get('LastModified')}"

    def put_if(self, key: str, data: bytes, expect: Expect) -> None:
        """Put ``data`` at ``key`` only if it holds what ``expect`` says, decided by the
        store: S3's If-None-Match: * (create only) or If-Match: <ETag> (replace only that
        one). A backend without conditions (not s3) checks the version first, then puts:
        the race is narrowed to the instant between, not closed."""
        protocol = self.fs.protocol
        if "s3" in ((protocol,) if isinstance(protocol, str) else tuple(protocol)):
            condition = ({"IfNoneMatch": "*"} if expect.version is None
                         else {"IfMatch": expect.version})
            self.fs.pipe_file(key, data, **condition)
            return
        relative = key[len(self._root):].lstrip("/")
        if self.version(relative) != expect.version:
            raise conflict(self.describe(relative), expect)
        self.fs.pipe_file(key, data)

    def _info(self, path: str, action: str) -> dict[str, Any]:
        with _translated(action, self.describe(path)):
            self._fresh()
            info = self.fs.info(self.key(path))
        if info.get("type") != "file":
            raise StorageError(f"{self.describe(path)} is not an object (a prefix?); checkpoints "
                               "only consist of objects, so this one is refused",
                               path=self.describe(path))
        return info

    def open_read(self, path: str) -> BinaryIO:
        self._info(path, "opening")
        with _translated("opening", self.describe(path)):
            return self.fs.open(self.key(path), "rb")

    def size(self, path: str) -> int:
        return int(self._info(path, "sizing")["size"])

    def mtime(self, path: str) -> float:
        self._info(path, "dating")
        with _translated("dating", self.describe(path)):
            return self.fs.modified(self.key(path)).timestamp()

    def remove(self, path: str) -> None:
        with _translated("removing", self.describe(path)), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.key(path))

    def remove_dir(self, path: str) -> None:
        """A prefix goes with its last object on S3; a store that keeps directories (a
        filer-backed one such as SeaweedFS) has its entry removed here. One that still
        has objects is refused, as a non-empty directory is."""
        if self.listdir(path):
            raise StorageError(f"removing {self.describe(path)}: it still holds objects",
                               path=self.describe(path))
        with _translated("removing", self.describe(path)), contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.key(path), recursive=True)

    def sync_dir(self, path: str = "") -> None:
        """A put or delete is durable once it returns: nothing to sync."""
