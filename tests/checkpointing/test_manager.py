"""The public API: round trips, async semantics, snapshot buffers, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest
import structlog
import torch
import xxhash

from checkpointing import (
    CheckpointConfigError,
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    StorageFullError,
    StoragePermissionError,
    UnsupportedStateError,
    _hooks,
)
from checkpointing.layout import MANIFEST_NAME, step_dir
from checkpointing.manifest import _body_digest

from .helpers import FaultyStorage, assert_same, make_state


def _train_one_step(model, optimizer, scheduler):
    model(torch.randn(4, 8)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def _training_objects(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    return model, optimizer, scheduler


def _full_state(model, optimizer, scheduler):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()}


@pytest.mark.parametrize("blocking", [True, False])
def test_round_trip_of_real_training_state(tmp_path, blocking):
    model, optimizer, scheduler = _training_objects(0)
    for _ in range(3):
        _train_one_step(model, optimizer, scheduler)
    saved = _full_state(model, optimizer, scheduler)
    manager = CheckpointManager(tmp_path)
    manager.save(3, saved, blocking=blocking)
    manager.wait()
    loaded = manager.load_latest()
    assert loaded.step == 3
    assert_same(loaded.state, saved)
    assert loaded.state["model"]._metadata == model.state_dict()._metadata
    model2, optimizer2, scheduler2 = _training_objects(1)
    model2.load_state_dict(loaded.state["model"])
    optimizer2.load_state_dict(loaded.state["optimizer"])
    scheduler2.load_state_dict(loaded.state["scheduler"])
    for m, o, s in ((model, optimizer, scheduler), (model2, optimizer2, scheduler2)):
        torch.set_rng_state(loaded.state["rng"])
        _train_one_step(m, o, s)  # resumed training continues identically
    assert_same(_full_state(model2, optimizer2, scheduler2), _full_state(model, optimizer, scheduler))


def test_manifest_records_what_was_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    manager = CheckpointManager(tmp_path)
    before = time.time()
    manager.save(7, make_state(7), metadata={"epoch": 2, "note": "x"})
    manifest = json.loads((tmp_path / step_dir(7) / MANIFEST_NAME).read_text())
    assert manifest["format_version"] == 2 and manifest["step"] == 7
    assert manifest["world_size"] == 4 and manifest["metadata"] == {"epoch": 2, "note": "x"}
    assert before <= manifest["wall_time"] <= time.time()
    ((name, entry),) = manifest["files"].items()
    raw = (tmp_path / step_dir(7) / name).read_bytes()
    assert entry == {"bytes": len(raw), "xxh3_128": xxhash.xxh3_128(raw).hexdigest()}
    assert manager.load_latest().manifest.metadata == {"epoch": 2, "note": "x"}
    assert CheckpointManager(tmp_path, world_size=8).load(7).manifest.world_size == 4


def test_a_checkpoint_of_format_1_with_sha256_digests_still_loads_and_is_verified(tmp_path):
    """Checkpoints written before xxh3_128 (format_version 1, a sha256 per file) load, and
    damage to one is still caught by its sha256."""
    manager = CheckpointManager(tmp_path)
    manager.save(3, make_state(3))
    path = tmp_path / step_dir(3) / MANIFEST_NAME
    body = json.loads(path.read_text())
    ((name, entry),) = body["files"].items()
    data = tmp_path / step_dir(3) / name
    body["format_version"] = 1
    body["files"] = {name: {"bytes": entry["bytes"],
                            "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}}
    body["manifest_sha256"] = _body_digest(body)
    path.write_text(json.dumps(body))
    loaded = CheckpointManager(tmp_path).load(3)
    assert loaded.manifest.format_version == 1
    assert loaded.manifest.files[name].algorithm == "sha256"
    assert_same(loaded.state, make_state(3))
    with open(data, "r+b") as f:
        f.seek(entry["bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="sha256 mismatch"):
        CheckpointManager(tmp_path).load(3)


def test_a_write_reports_where_its_time_went(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, make_state(1), blocking=False)
    manager.wait()
    report = manager.last_write
    assert report is not None and report.manifest.step == 1
    assert report.bytes == sum(e.bytes for e in report.manifest.files.values())
    assert 0 < report.hash_s + report.write_s <= report.serialize_s <= report.seconds
    assert 0 < report.commit_s <= report.seconds and report.cpu_s > 0
    assert set(report.as_log()) >= {"bytes", "cpu_s", "hash_s", "commit_mb_per_s"}


def test_async_save_is_isolated_from_later_mutation(tmp_path):
    state = make_state(1)
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, blocking=False)
    state["model"]["weight"].add_(1.0)  # the next optimizer step, in place
    state["optimizer"]["param_groups"][0]["lr"] = 123.0
    state["flags"].append("late")
    manager.wait()
    assert_same(manager.load_latest().state, make_state(1))


def test_snapshot_buffers_are_reused_and_reallocated_on_change(tmp_path):
    manager = CheckpointManager(tmp_path)
    snap = manager._snapshotter
    manager.save(1, make_state(1), blocking=False)
    first = snap.allocated_bytes
    pointer = snap._buffers[("model", "weight")].data_ptr()
    for step in (2, 3):
        manager.save(step, make_state(step), blocking=False)
    manager.wait()
    assert snap.allocated_bytes == first
    assert snap._buffers[("model", "weight")].data_ptr() == pointer
    bigger = make_state(4)
    bigger["model"]["weight"] = torch.zeros(10)
    manager.save(4, bigger, blocking=False)
    manager.wait()
    assert snap.allocated_bytes == first + 10 * 4
    assert_same(manager.load_latest().state, bigger)


@pytest.mark.parametrize("blocking", [True, False])
def test_shared_tensors_stay_shared_and_views_are_compact(tmp_path, blocking):
    big = torch.arange(1_000_000, dtype=torch.float32)
    tied = torch.ones(100)
    manager = CheckpointManager(tmp_path)
    manager.save(1, {"a": tied, "b": tied, "view": big[10:20], "t": big[::250_000]},
                 blocking=blocking)
    manager.wait()
    state = manager.load_latest().state
    assert state["a"].data_ptr() == state["b"].data_ptr()
    assert torch.equal(state["view"], big[10:20]) and torch.equal(state["t"], big[::250_000])
    (data,) = (tmp_path / step_dir(1)).glob("state-*.pt")
    assert data.stat().st_size < 100_000  # not the 4 MB storage behind the view


def test_at_most_one_write_in_flight(tmp_path):
    release, paused = threading.Event(), threading.Event()

    def hook(name, path):
        if name == "write.fsynced" and "state-" in path and not release.is_set():
            paused.set()
            release.wait(10)

    manager = CheckpointManager(tmp_path)
    _hooks.phase_hook = hook
    try:
        manager.save(1, make_state(1), blocking=False)
        assert paused.wait(10)
        second = threading.Thread(target=manager.save, args=(2, make_state(2)),
                                  kwargs={"blocking": False})
        second.start()
        second.join(0.3)
        assert second.is_alive(), "a second save started while the first was writing"
        release.set()
        second.join(10)
        manager.wait()
    finally:
        _hooks.phase_hook = None
        release.set()
    assert manager.steps() == [1, 2]


def test_background_error_surfaces_on_wait_then_clears(tmp_path):
    storage = FaultyStorage(tmp_path)
    manager = CheckpointManager(tmp_path, storage=storage)
    manager.save(1, make_state(1))
    storage.space_left = 10_000
    with structlog.testing.capture_logs() as logs:
        manager.save(2, make_state(2), blocking=False)  # returns: the write fails later
        while manager.writing:
            time.sleep(0.01)
    assert [e["log_level"] for e in logs if e["event"] == "checkpoint_background_failed"] == [
        "error"]  # logged when it happens, even if nobody calls wait()
    with pytest.raises(StorageFullError, match="No space left") as info:
        manager.wait()
    assert "background save" in " ".join(info.value.__notes__)
    manager.wait()  # raised once, not forever
    storage.space_left = None
    manager.save(3, make_state(3))
    assert manager.steps() == [1, 3]


def test_background_error_surfaces_on_next_save(tmp_path):
    storage = FaultyStorage(tmp_path)
    manager = CheckpointManager(tmp_path, storage=storage)
    storage.space_left = 10_000
    manager.save(1, make_state(1), blocking=False)
    with pytest.raises(StorageFullError):
        manager.save(2, make_state(2), blocking=False)
    storage.space_left = None
    manager.save(2, make_state(2), blocking=False)
    manager.wait()
    assert manager.steps() == [2]


def test_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(5, make_state(1))
    manager.save(5, make_state(2), blocking=False)
    manager.wait()
    assert_same(manager.load_latest().state, make_state(2))
    assert len(list((tmp_path / step_dir(5)).glob("state-*.pt"))) == 1


def test_latest_step_and_steps(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    assert manager.latest_step() is None
    for step in (3, 10, 7):
        manager.save(step, make_state(step), blocking=False)
    assert manager.latest_step() == 10  # waits for the in-flight write
    assert manager.steps() == [7, 10]  # step 3 fell out of retention


def test_read_only_manager(tmp_path):
    CheckpointManager(tmp_path).save(1, make_state(1))
    reader = CheckpointManager(tmp_path, read_only=True)
    assert reader.load_latest().step == 1
    with pytest.raises(CheckpointConfigError, match="read_only"):
        reader.save(2, make_state(2))


def test_context_manager_waits(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, make_state(1), blocking=False)
    assert CheckpointManager(tmp_path).latest_step() == 1


def test_exit_on_an_exception_does_not_hide_it(tmp_path):
    storage = FaultyStorage(tmp_path)
    with (
        pytest.raises(KeyError, match="training failed"),
        structlog.testing.capture_logs() as logs,
        CheckpointManager(tmp_path, storage=storage) as manager,
    ):
        storage.space_left = 100
        manager.save(1, make_state(1), blocking=False)
        raise KeyError("training failed")
    assert "checkpoint_failed_during_exit" in [e["event"] for e in logs]


@pytest.mark.process
def test_interpreter_exit_finishes_the_in_flight_write(tmp_path):
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[2]);"
        "from checkpointing import CheckpointManager;"
        "CheckpointManager(sys.argv[1]).save(9, {'w': torch.ones(1 << 20)}, blocking=False)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code, str(tmp_path), root], check=True, timeout=60)
    assert torch.equal(CheckpointManager(tmp_path).load_latest().state["w"], torch.ones(1 << 20))


# -- bad input ----------------------------------------------------------------------


def test_keep_last_below_two_says_how_to_fix(tmp_path):
    with pytest.raises(CheckpointConfigError) as info:
        CheckpointManager(tmp_path, keep_last=1)
    assert str(info.value) == (
        "keep_last=1: keep_last must be >= 2 so a crash during a save always leaves a valid "
        "older checkpoint; set keep_last=2 or more"
    )
    for bad in (True, 2.0, "3"):
        with pytest.raises(CheckpointConfigError):
            CheckpointManager(tmp_path, keep_last=bad)


@pytest.mark.parametrize(
    ("option", "message"),
    [({"stale_temp_seconds": 0}, "stale_temp_seconds=0 must be > 0"),
     ({"world_size": 0}, "world_size=0 must be an int >= 1")],
)
def test_bad_options(tmp_path, option, message):
    with pytest.raises(CheckpointConfigError, match=message):
        CheckpointManager(tmp_path, **option)


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_bad_step(tmp_path, step):
    with pytest.raises(CheckpointConfigError, match="int >= 0"):
        CheckpointManager(tmp_path).save(step, {"x": 1})


@pytest.mark.parametrize("metadata", [{"x": float("nan")}, {"x": object()}, ["not", "dict"]])
def test_bad_metadata(tmp_path, metadata):
    with pytest.raises(CheckpointConfigError, match="metadata"):
        CheckpointManager(tmp_path).save(1, {"x": 1}, metadata=metadata)


class Foo:
    pass


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"optimizer": {"param_groups": [{"foo": Foo()}]}},
         f"state['optimizer']['param_groups'][0]['foo'] is a {Foo}; only tensors, numbers, "
         "str, bool, None, lists, tuples and dicts are saved"),
        ({"rng": {"numpy": np.zeros(3)}}, "state['rng']['numpy'] is a <class 'numpy.ndarray'>"),
        ({"lr": np.float64(0.1)}, "state['lr'] is a <class 'numpy.float64'>"),
        ({"s": {1, 2}}, "state['s'] is a <class 'set'>"),
        ({"d": {(1, 2): 3}}, "state['d'] has a key (1, 2) of <class 'tuple'>"),
        ({"w": torch.zeros(3).to_sparse()}, "state['w'] is a tensor with layout torch.sparse_coo"),
        ({"w": torch.empty(3, device="meta")}, "state['w'] is on the meta device"),
    ],
    ids=["object", "ndarray", "np-scalar", "set", "tuple-key", "sparse", "meta"],
)
def test_unsupported_state_is_named_by_path(tmp_path, state, message, blocking):
    manager = CheckpointManager(tmp_path)
    with pytest.raises(UnsupportedStateError) as info:
        manager.save(1, state, blocking=blocking)
    assert message in str(info.value)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, TypeError)
    assert manager.steps() == [] and not list(tmp_path.glob("step-*"))


def test_directory_that_is_a_file(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(StoragePermissionError, match="not a directory.*writable directory"):
        CheckpointManager(target)


@pytest.fixture
def read_only_mount(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)],
                            capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {result.stderr.decode().strip()}")
    yield target
    subprocess.run(["umount", "-l", str(target)], check=True)


def test_read_only_directory(read_only_mount):
    with pytest.raises(StoragePermissionError, match="Read-only file system"):
        CheckpointManager(read_only_mount)
    with pytest.raises(StoragePermissionError, match="Read-only file system"):
        CheckpointManager(read_only_mount / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_directory_without_write_permission(tmp_path):
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(StoragePermissionError, match="Permission denied"):
            CheckpointManager(tmp_path)
    finally:
        tmp_path.chmod(0o700)


def test_ordered_dict_and_tuples_round_trip(tmp_path):
    state = {"od": OrderedDict(b=1, a=2), "t": (1, (2.5, "x")), "size": torch.Size([2, 3]),
             "big": 2**70, "neg": -3, "s": "é", "n": None, "keys": {1: "a", None: "b"}}
    manager = CheckpointManager(tmp_path)
    manager.save(1, state, blocking=False)
    manager.wait()
    assert_same(manager.load_latest().state, state)
