"""Disk full: the save fails with StorageFullError, the previous checkpoint stays intact and
loadable, the failed write leaves nothing behind, and saving works again once space is back.

Runs on a real small tmpfs where mounting is allowed (root), and always through a
fault-injecting storage that fails like a full disk, including between data and manifest."""

from __future__ import annotations

import subprocess

import pytest
import torch

from checkpointing import CheckpointManager, StorageFullError

from .helpers import FaultyStorage, assert_same, make_state

SMALL = 1 << 14  # ~0.1 MB of state
LARGE = 1 << 20  # ~5 MB of state: does not fit on the 2 MB tmpfs


@pytest.fixture
def tiny_tmpfs(tmp_path):
    target = tmp_path / "tiny"
    target.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(target)],
                            capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=True)


def _no_leftovers(directory) -> None:
    names = [p.name for p in directory.rglob("*") if p.is_file()]
    assert not [n for n in names if n.startswith(".tmp-")], names
    assert len([n for n in names if n.startswith("state-")]) == 1, names


@pytest.mark.parametrize("blocking", [True, False])
def test_enospc_on_a_real_tmpfs(tiny_tmpfs, blocking):
    manager = CheckpointManager(tiny_tmpfs)
    manager.save(1, make_state(1, SMALL))
    with pytest.raises(StorageFullError, match="No space left on device.*free space") as info:
        manager.save(2, make_state(2, LARGE), blocking=blocking)
        manager.wait()
    assert info.value.errno == 28
    loaded = manager.load_latest()
    assert loaded.step == 1
    assert_same(loaded.state, make_state(1, SMALL))
    _no_leftovers(tiny_tmpfs)
    manager.save(3, make_state(3, SMALL), blocking=blocking)  # space was given back
    manager.wait()
    assert manager.steps() == [1, 3]


@pytest.mark.parametrize("where", ["data", "manifest"])
@pytest.mark.parametrize("blocking", [True, False])
def test_enospc_injected(tmp_path, where, blocking):
    storage = FaultyStorage(tmp_path)
    manager = CheckpointManager(tmp_path, storage=storage)
    manager.save(1, make_state(1, SMALL))
    data_size = next(tmp_path.rglob("state-*.pt")).stat().st_size
    # Room for part of the data, or for all of it but not the manifest.
    storage.space_left = data_size // 2 if where == "data" else data_size + 10
    with pytest.raises(StorageFullError):
        manager.save(2, make_state(1, SMALL), blocking=blocking)
        manager.wait()
    storage.space_left = None
    assert manager.steps() == [1]
    assert_same(manager.load_latest().state, make_state(1, SMALL))
    _no_leftovers(tmp_path)
    assert torch.equal(manager.load(1).state["model"]["bias"], torch.full((64,), 1.0))
