"""LocalStorage keeps the Storage contract: atomic publish, idempotent removal, errors
translated into the package's exceptions."""

from __future__ import annotations

import os
import zipfile

import pytest

from checkpointing import CheckpointManager, LocalStorage, Storage, StorageNotFoundError
from checkpointing.layout import TEMP_PREFIX

from .helpers import assert_same, make_state


def test_local_storage_is_a_storage(tmp_path):
    assert isinstance(LocalStorage(tmp_path), Storage)


def test_write_is_invisible_until_commit_and_replaces_atomically(tmp_path):
    storage = LocalStorage(tmp_path)
    (tmp_path / "f").write_bytes(b"old")
    with storage.open_write("f") as out:
        out.write(b"new ")
        out.write(memoryview(b"content"))
        assert (tmp_path / "f").read_bytes() == b"old"
        (temp,) = [n for n in os.listdir(tmp_path) if n.startswith(TEMP_PREFIX)]
        out.commit()
    assert (tmp_path / "f").read_bytes() == b"new content"
    assert os.listdir(tmp_path) == ["f"]


def test_leaving_without_commit_discards(tmp_path):
    storage = LocalStorage(tmp_path)
    with pytest.raises(RuntimeError), storage.open_write("f") as out:
        out.write(b"partial")
        raise RuntimeError("writer crashed")
    assert os.listdir(tmp_path) == []


def test_idempotent_operations(tmp_path):
    storage = LocalStorage(tmp_path)
    storage.remove("missing")
    storage.remove_dir("missing")
    storage.make_dir("d")
    storage.make_dir("d")
    assert storage.is_dir("d") and storage.listdir("nowhere") == []


def test_errors_are_translated(tmp_path):
    storage = LocalStorage(tmp_path)
    with pytest.raises(StorageNotFoundError) as info:
        storage.open_write("no/such/dir/f")
    assert info.value.errno == 2 and "no/such/dir/f" in str(info.value)
    with pytest.raises(StorageNotFoundError):
        storage.size("missing")


class StreamOnly(LocalStorage):
    """A storage that cannot be memory-mapped (like an object store)."""

    def local_path(self, path):
        return None


def test_checkpoints_load_through_streams_when_mmap_is_unavailable(tmp_path):
    manager = CheckpointManager(tmp_path, storage=StreamOnly(tmp_path))
    manager.save(1, make_state(1), blocking=False)
    manager.wait()
    assert_same(manager.load_latest().state, make_state(1))


@pytest.mark.parametrize("crc_free", [True, False])
def test_serialization_with_and_without_torch_crc(tmp_path, monkeypatch, crc_free):
    from checkpointing import writer

    if not crc_free:  # what happens if torch's private writer API changes
        monkeypatch.setattr(writer, "_crc_free_save_available", lambda: False)
    else:
        assert writer._crc_free_save_available(), "torch changed: the CRC-free path is gone"
    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state(1))
    (data,) = tmp_path.glob("step-*/state-*.pt")
    crcs = [info.CRC for info in zipfile.ZipFile(data).infolist() if info.file_size]
    assert all(c == 0 for c in crcs) if crc_free else all(c != 0 for c in crcs)
    assert_same(manager.load_latest().state, make_state(1))
