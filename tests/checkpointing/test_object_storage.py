"""One Storage contract, run against each implementation: a local directory and a bucket
on a real S3-compatible server (SeaweedFS on 127.0.0.1, ``tests/conftest.py``), then the
checkpoint manager's guarantees on the bucket: save and verified load, fallback past a
corrupt or partial newest checkpoint, retention only after a newer commit, the
generation fence, a refused write."""

from __future__ import annotations

import pytest
import s3fs

from checkpointing import (
    CheckpointManager,
    LocalStorage,
    ObjectStorage,
    StaleGenerationError,
    Storage,
    StorageConflictError,
    StorageError,
    StorageNotFoundError,
    StoragePermissionError,
    _hooks,
    open_storage,
)
from checkpointing.layout import MANIFEST_NAME, step_dir
from checkpointing.storage import Expect

from .helpers import assert_same, make_state


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path, object_store) -> Storage:
    # object_store named here, not only through `bucket`: a session fixture first asked
    # for inside a test would be taken for a process that test leaked.
    if request.param == "local":
        (tmp_path / "root").mkdir()
        return LocalStorage(tmp_path / "root")
    return open_storage(request.getfixturevalue("bucket"))


def _names(storage: Storage, path: str = "") -> list[str]:
    return sorted(storage.listdir(path))


def test_each_is_a_storage_and_urls_open_a_bucket(storage, tmp_path):
    assert isinstance(storage, Storage)
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage("s3://some-bucket/prefix"), ObjectStorage)


def test_a_write_is_invisible_until_commit_then_replaces_whole(storage):
    storage.check_writable()
    storage.make_dir("d")
    with storage.open_write("d/f") as out:
        out.write(b"old")
        out.commit()
    with storage.open_write("d/f") as out:
        out.write(b"new ")
        out.write(memoryview(b"content"))
        with storage.open_read("d/f") as f:
            assert f.read() == b"old"
        out.commit()
    with storage.open_read("d/f") as f:
        assert f.read() == b"new content"
    assert storage.size("d/f") == len(b"new content") and storage.mtime("d/f") > 0
    assert _names(storage) == ["d"] and _names(storage, "d") == ["f"]


def test_leaving_without_commit_leaves_nothing(storage):
    storage.make_dir("d")
    with pytest.raises(RuntimeError), storage.open_write("d/f") as out:
        out.write(b"partial")
        raise RuntimeError("writer crashed")
    assert _names(storage, "d") == []
    with pytest.raises(StorageNotFoundError):
        storage.size("d/f")


def test_removal_is_idempotent_and_a_missing_dir_lists_empty(storage):
    storage.remove("missing")
    storage.remove_dir("missing")
    storage.make_dir("d")
    storage.make_dir("d")
    assert storage.listdir("nowhere") == []
    with storage.open_write("d/f") as out:
        out.write(b"x")
        out.commit()
    assert storage.is_dir("d")
    with pytest.raises(StorageError):
        storage.remove_dir("d")          # not empty
    storage.remove("d/f")
    storage.remove_dir("d")
    assert not storage.is_dir("d") and _names(storage) == []


def test_only_files_are_read(storage):
    storage.make_dir("d")
    with storage.open_write("d/f") as out:
        out.write(b"x")
        out.commit()
    with pytest.raises(StorageError):
        storage.open_read("d")
    with pytest.raises(StorageNotFoundError):
        storage.open_read("d/missing")


def _put(storage: Storage, path: str, data: bytes, expect: Expect | None = None) -> None:
    with storage.open_write(path, expect) as out:
        out.write(data)
        out.commit()


def _read(storage: Storage, path: str) -> bytes:
    with storage.open_read(path) as f:
        return f.read()


def test_a_conditional_create_never_replaces_what_another_writer_put(storage):
    storage.make_dir("d")
    assert storage.version("d/m") is None
    _put(storage, "d/m", b"first", Expect(None))
    assert storage.version("d/m") is not None
    with pytest.raises(StorageConflictError, match="another writer committed"):
        _put(storage, "d/m", b"second", Expect(None))
    assert _read(storage, "d/m") == b"first"
    assert [n for n in storage.listdir("d") if n != "m"] == []   # no temp object left


def test_a_conditional_replace_takes_only_the_version_it_was_given(storage):
    storage.make_dir("d")
    _put(storage, "d/m", b"one")
    seen = storage.version("d/m")
    _put(storage, "d/m", b"two", Expect(seen))
    assert _read(storage, "d/m") == b"two" and storage.version("d/m") != seen
    with pytest.raises(StorageConflictError, match="was replaced"):
        _put(storage, "d/m", b"three", Expect(seen))   # "two" came in between
    assert _read(storage, "d/m") == b"two"


def test_a_writer_that_loses_the_race_for_a_step_leaves_the_winners_checkpoint(storage):
    """Two writers save the same step (a stale world's writer that slipped past the fence
    check, and the current one): the one that commits second is refused, and the first's
    checkpoint stays committed and whole (before: its manifest was overwritten, then taken
    back by the loser's after-commit check, and the step had no checkpoint at all)."""
    late = CheckpointManager("late", storage=storage)
    first = CheckpointManager("first", storage=storage)

    def hook(phase: str, path: str) -> None:
        if phase == "checkpoint.data_committed" and _hooks.phase_hook is hook:
            _hooks.phase_hook = None       # the winner's own save runs without the hook
            first.save(7, make_state(70))
            # Its retention runs in the background and takes temps of this process for a
            # dead writer's: two real writers are two processes. Let it finish first.
            first.wait()
    _hooks.phase_hook = hook
    try:
        with pytest.raises(StorageConflictError):
            late.save(7, make_state(7))
    finally:
        _hooks.phase_hook = None
    loaded = CheckpointManager("reader", storage=storage, read_only=True).load(7)
    assert_same(loaded.state, make_state(70))
    assert len([n for n in storage.listdir(step_dir(7)) if n != MANIFEST_NAME]) == 1
    late.close()
    first.close()


def test_a_missing_bucket_names_itself(object_store):
    with pytest.raises(StorageError, match="s3://no-such-bucket-elasticd"):
        open_storage("s3://no-such-bucket-elasticd/ckpt").check_writable()


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "async"])
def test_save_and_load_through_the_bucket(bucket, background):
    manager = CheckpointManager(bucket, keep_last=2)
    for step in (10, 20, 30):
        manager.save(step, make_state(step), blocking=not background)
    manager.wait()
    loaded = CheckpointManager(bucket, read_only=True).load_latest()
    assert loaded.step == 30
    assert_same(loaded.state, make_state(30))
    # Retention after the newer commit: only the newest two remain.
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(bucket)) == [step_dir(20), step_dir(30)]
    manager.close()


def test_a_corrupt_or_partial_newest_checkpoint_falls_back_to_the_previous(bucket):
    manager = CheckpointManager(bucket, keep_last=3)
    manager.save(10, make_state(10))
    manager.save(20, make_state(20))
    manager.wait()
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    newest = f"{bucket}/{step_dir(20)}"
    data = [p for p in fs.ls(newest) if not p.endswith(MANIFEST_NAME)][0]
    fs.pipe_file(data, b"not the bytes the manifest names")
    assert CheckpointManager(bucket, read_only=True).load_latest().step == 10
    fs.rm_file(f"{newest}/{MANIFEST_NAME}")   # a partial checkpoint: no commit marker
    fs.invalidate_cache()
    loaded = CheckpointManager(bucket, read_only=True).load_latest()
    assert loaded.step == 10
    assert_same(loaded.state, make_state(10))
    manager.close()


def test_the_fence_refuses_a_stale_writer_on_the_bucket(bucket):
    old = CheckpointManager(bucket, generation=1, generation_epoch="e")
    new = CheckpointManager(bucket, generation=2, generation_epoch="e")
    new.save(5, make_state(5))
    new.wait()
    with pytest.raises(StaleGenerationError):
        old.save(6, make_state(6))
        old.wait()
    assert CheckpointManager(bucket, read_only=True).load_latest().step == 5
    old.close()
    new.close()


def test_an_unreachable_store_fails_at_open_naming_it_and_keeps_the_committed(bucket,
                                                                           object_store):
    manager = CheckpointManager(bucket)
    manager.save(1, make_state(1))
    manager.wait()
    unreachable = ObjectStorage(bucket, {**object_store.storage_options,
                                         "client_kwargs": {"endpoint_url": "http://127.0.0.1:9",
                                                           "region_name": "us-east-1"},
                                         "config_kwargs": {"retries": {"max_attempts": 1},
                                                           "connect_timeout": 1}})
    with pytest.raises(StorageError, match=bucket.replace("/", "/")):
        CheckpointManager(bucket, storage=unreachable)
    assert CheckpointManager(bucket, read_only=True).load_latest().step == 1
    manager.close()


def test_a_bucket_that_refuses_this_nodes_writes_is_refused_at_open_and_stays_readable(
        bucket, object_store):
    """Credentials that may read and list but not write (a role without s3:PutObject):
    the manager refuses to open for writing, naming the fix; the committed checkpoint is
    intact and loads with the same read-only credentials."""
    from elasticd.lab.object_store import READER

    writer = CheckpointManager(bucket)
    writer.save(1, make_state(1))
    writer.wait()
    writer.close()
    reader = ObjectStorage(bucket, object_store.options_for(READER))
    with pytest.raises(StoragePermissionError, match="read and write access"):
        CheckpointManager(bucket, storage=reader)
    loaded = CheckpointManager(bucket, storage=reader, read_only=True).load_latest()
    assert loaded.step == 1
    assert_same(loaded.state, make_state(1))
