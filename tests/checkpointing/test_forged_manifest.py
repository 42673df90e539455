"""Forged manifests and non-regular files: the checkpoint is skipped, nothing crashes or hangs.

A manifest is input. These manifests carry a *valid* self-checksum (a forger can compute
it), so every value read from them must be checked on its own. Real directories, real
FIFOs and symlinks; every case must end in the "damaged checkpoint skipped" path.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from checkpointing import CheckpointManager, CorruptCheckpointError
from checkpointing.layout import MANIFEST_NAME, is_safe_file_name, step_dir
from checkpointing.manifest import _body_digest

from .helpers import assert_same, make_state


@pytest.fixture(autouse=True)
def no_hang():
    """A FIFO that is opened blocking hangs forever: fail the test instead."""
    def _timeout(*_):
        raise TimeoutError("checkpoint reader hung (a FIFO opened or read blocking?)")

    previous = signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def two_steps(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    manager.save(1, make_state(1, numel=256))
    manager.save(2, make_state(2, numel=256))
    manager.wait()
    return manager, tmp_path / step_dir(2)


def _forge(directory, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the manifest with `edit` applied and a matching self-checksum."""
    path = directory / MANIFEST_NAME
    body = json.loads(path.read_bytes())
    edit(body)
    body["manifest_sha256"] = _body_digest(body)
    path.write_text(json.dumps(body))


def _rename_file(new_name: str) -> Callable[[dict[str, Any]], None]:
    def edit(body):
        ((_, entry),) = body["files"].items()
        body["files"] = {new_name: entry}
    return edit


def _set_entry(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body):
        ((_, entry),) = body["files"].items()
        entry[key] = value
    return edit


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(body):
        body[key] = value
    return edit


def _expect_skipped(manager: CheckpointManager, reason_part: str, path_part: str) -> None:
    """Step 2 is skipped with one warning naming the file and the reason; step 1 loads."""
    with structlog.testing.capture_logs() as logs:
        loaded = manager.load_latest()
    assert loaded is not None and loaded.step == 1
    assert_same(loaded.state, make_state(1, numel=256))
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1, logs
    assert reason_part in skipped[0]["reason"], skipped[0]
    assert path_part in skipped[0]["path"], skipped[0]
    assert manager.steps() == [1] and manager.latest_step() == 1
    with pytest.raises(CorruptCheckpointError):
        manager.load(2)
    # The writer's retention and cleanup read the same manifest: no exception, no hang.
    manager.save(3, make_state(3, numel=256))
    manager.wait()
    assert manager.load_latest().step == 3


@pytest.mark.parametrize("name", [
    "a\x00b", "../" + step_dir(1) + "/x.pt", "..", ".", "/etc/passwd", "sub/x.pt",
    ".tmp-1-h-0123456789ab", "", "a\nb", "x" * 300,
], ids=["nul", "traversal", "dotdot", "dot", "absolute", "separator", "temp", "empty",
        "newline", "too-long"])
def test_invalid_file_names(two_steps, name):
    manager, directory = two_steps
    _forge(directory, _rename_file(name))
    _expect_skipped(manager, "invalid file name", MANIFEST_NAME)


@pytest.mark.parametrize(("edit", "reason"), [
    (_set_entry("bytes", -1), "out of range"),
    (_set_entry("bytes", "12"), "malformed"),
    (_set_entry("bytes", 1.5), "malformed"),
    (_set_entry("bytes", True), "malformed"),
    (_set_entry("bytes", None), "malformed"),
    (_set_entry("xxh3_128", "z" * 32), "xxh3_128"),
    (_set_entry("xxh3_128", "A" * 32), "xxh3_128"),
    (_set_entry("xxh3_128", "a" * 64), "xxh3_128"),
    (_set_entry("xxh3_128", 123), "xxh3_128"),
    (_set_entry("sha256", "a" * 64), "names 2 digests"),   # two digests: which one counts?
    (_set("format_version", 3), "upgrade this node's elasticd"),
    (_set("step", "2"), "'step'"),
    (_set("step", 2.0), "'step'"),
    (_set("step", True), "'step'"),
    (_set("step", 3), "manifest says step 3"),
    (_set("world_size", -1), "'world_size'"),
    (_set("files", []), "'files'"),
    (_set("files", {}), "no files"),
    (_set("files", {"state-x.pt": [1, 2]}), "malformed"),
    (_set("metadata", [1]), "'metadata'"),
    (_set("format_version", True), "format_version"),
    (_set("wall_time", "now"), "'wall_time'"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_wrong_types_and_values(two_steps, edit, reason):
    manager, directory = two_steps
    _forge(directory, edit)
    _expect_skipped(manager, reason, MANIFEST_NAME)


@pytest.mark.parametrize("raw", [
    b'{"format": "elasticd-checkpoint", "format_version": 1, "step": NaN}',
    b'{"format": "elasticd-checkpoint", "format_version": 1, "wall_time": 1e999}',
    b'{"format": "elasticd-checkpoint", "format_version": 1, "step": ' + b"9" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a": "\xff\xfe"}',
], ids=["nan", "overflowing-float", "5000-digit-int", "deep-nesting", "not-utf8"])
def test_json_that_python_refuses_in_other_ways(two_steps, raw):
    """json raises ValueError (not JSONDecodeError) or RecursionError for these."""
    manager, directory = two_steps
    (directory / MANIFEST_NAME).write_bytes(raw)
    _expect_skipped(manager, "not valid JSON", MANIFEST_NAME)


def _data_file(directory):
    (path,) = directory.glob("state-*.pt")
    return path


def test_a_fifo_named_in_the_manifest_is_refused_without_hanging(two_steps):
    manager, directory = two_steps
    data = _data_file(directory)
    data.unlink()
    os.mkfifo(data)
    _expect_skipped(manager, "not a regular file", data.name)


def test_a_fifo_as_the_manifest_is_refused_without_hanging(two_steps):
    manager, directory = two_steps
    (directory / MANIFEST_NAME).unlink()
    os.mkfifo(directory / MANIFEST_NAME)
    _expect_skipped(manager, "not a regular file", MANIFEST_NAME)


@pytest.mark.parametrize("target", ["older-data", "fifo"])
def test_a_symlink_named_in_the_manifest_is_refused(two_steps, tmp_path, target):
    """Checkpoints are written as regular files only; a symlink could point anywhere."""
    manager, directory = two_steps
    data = _data_file(directory)
    if target == "fifo":
        pointee = tmp_path / "fifo"
        os.mkfifo(pointee)
    else:
        pointee = tmp_path / "copy.pt"
        pointee.write_bytes(data.read_bytes())  # same bytes: only the file type is wrong
    data.unlink()
    data.symlink_to(pointee)
    _expect_skipped(manager, "not a regular file", data.name)


def test_a_manifest_far_too_big_is_not_read_whole(two_steps):
    manager, directory = two_steps
    with open(directory / MANIFEST_NAME, "r+b") as f:
        f.truncate(17 << 20)  # sparse: cheap on disk
    _expect_skipped(manager, "larger than", MANIFEST_NAME)


def test_safe_names_are_what_the_writer_writes():
    assert is_safe_file_name("state-123-host-0123456789ab.pt")
    for bad in ("a\x00b", "a/b", "..", ".hidden", "", None, 7, "a b", "a\\b"):
        assert not is_safe_file_name(bad), bad
