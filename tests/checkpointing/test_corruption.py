"""A damaged newest checkpoint is skipped with a warning naming the file and the reason,
and the next older valid one is loaded. Loading never raises for damage."""

from __future__ import annotations

import pytest
import structlog
import torch
import xxhash

from checkpointing import (
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FileEntry,
    Manifest,
)
from checkpointing.layout import MANIFEST_NAME, step_dir

from .helpers import assert_same, make_state


@pytest.fixture
def two_steps(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, make_state(1))
    manager.save(2, make_state(2))
    manager.wait()
    return manager, tmp_path / step_dir(2)


def _data_file(directory):
    (path,) = directory.glob("state-*.pt")
    return path


def _load_expecting_fallback(manager, reason_part: str, file_part: str):
    with structlog.testing.capture_logs() as logs:
        loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    assert_same(loaded.state, make_state(1))
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0]["log_level"] == "warning"
    assert reason_part in skipped[0]["reason"], skipped[0]
    assert file_part in skipped[0]["path"], skipped[0]


def test_truncated_data_file(two_steps):
    manager, directory = two_steps
    data = _data_file(directory)
    data.write_bytes(data.read_bytes()[:-1000])
    _load_expecting_fallback(manager, "truncated", data.name)
    assert manager.latest_step() == 1  # the cheap check sees the size too


def test_flipped_byte(two_steps):
    manager, directory = two_steps
    data = _data_file(directory)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    _load_expecting_fallback(manager, "xxh3_128 mismatch", data.name)
    assert manager.latest_step() == 2  # documented: latest_step does not hash
    with pytest.raises(CorruptCheckpointError, match="xxh3_128 mismatch"):
        manager.load(2)


def test_missing_manifest(two_steps):
    manager, directory = two_steps
    (directory / MANIFEST_NAME).unlink()
    _load_expecting_fallback(manager, "no manifest", MANIFEST_NAME)
    assert manager.steps() == [1]


def test_manifest_points_at_missing_file(two_steps):
    manager, directory = two_steps
    data = _data_file(directory)
    data.unlink()
    _load_expecting_fallback(manager, "missing", data.name)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda raw: raw[: len(raw) // 2], "not valid JSON"),
        (lambda raw: b"", "not valid JSON"),
        (lambda raw: raw.replace(b'"step": 2', b'"step": 7'), "checksum mismatch"),
        (lambda raw: raw.replace(b'"format_version": 2', b'"format_version": 99'), "format_version"),
        (lambda raw: b"[1, 2]", "not a JSON object"),
    ],
    ids=["half", "empty", "step-digit", "version", "not-object"],
)
def test_damaged_manifest(two_steps, damage, reason):
    manager, directory = two_steps
    manifest = directory / MANIFEST_NAME
    manifest.write_bytes(damage(manifest.read_bytes()))
    _load_expecting_fallback(manager, reason, MANIFEST_NAME)


def test_manifest_of_another_step(two_steps, tmp_path):
    manager, directory = two_steps
    (directory / MANIFEST_NAME).unlink()
    for f in (tmp_path / step_dir(1)).iterdir():
        (directory / f.name).write_bytes(f.read_bytes())  # step 1's files under step 2
    _load_expecting_fallback(manager, "manifest says step 1", MANIFEST_NAME)


class NotAllowed:
    """Unpickling this would run arbitrary code in a weights_only=False load."""

    def __reduce__(self):
        return (print, ("arbitrary code ran",))


def test_pickled_object_is_refused_even_with_matching_checksums(two_steps):
    manager, directory = two_steps
    data = _data_file(directory)
    torch.save({"model": NotAllowed()}, data)
    raw = data.read_bytes()
    forged = Manifest(step=2, wall_time=0.0, world_size=1,
                      files={data.name: FileEntry(len(raw), xxhash.xxh3_128(raw).hexdigest())})
    (directory / MANIFEST_NAME).write_bytes(forged.to_json())
    _load_expecting_fallback(manager, "torch.load failed", data.name)


def test_all_damaged_returns_none(two_steps, tmp_path):
    manager, _ = two_steps
    for step in (1, 2):
        (tmp_path / step_dir(step) / MANIFEST_NAME).write_bytes(b"{")
    with structlog.testing.capture_logs() as logs:
        assert manager.load_latest() is None
    assert sum(e["event"] == "checkpoint_skipped" for e in logs) == 2
    assert manager.latest_step() is None


def test_empty_directory(tmp_path):
    manager = CheckpointManager(tmp_path / "new")
    assert manager.load_latest() is None and manager.latest_step() is None
    with pytest.raises(CheckpointNotFoundError):
        manager.load(3)
