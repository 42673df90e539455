"""Retention keeps the newest keep_last committed checkpoints and never the newest valid
one; leftovers of crashed writers go; a live writer's files stay; failures do not stop
training."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from checkpointing import CheckpointManager
from checkpointing.layout import MANIFEST_NAME, Owner, data_name, step_dir, temp_name
from checkpointing.retention import StalePolicy, plan_retention

from .helpers import FaultyStorage, assert_same, make_state

NUMEL = 1 << 12


@given(st.sets(st.integers(0, 50)), st.integers(2, 6), st.sets(st.integers(0, 50), max_size=2))
def test_plan_retention_properties(committed, keep_last, protect):
    doomed = set(plan_retention(committed, keep_last, protect))
    newest = set(sorted(committed)[-keep_last:])
    assert doomed == committed - newest - protect


def test_stale_policy():
    me = Owner(100, "hostA")
    policy = StalePolicy(max_age=60, me=me, alive=lambda pid: pid == 200)
    now = 1000.0
    assert policy.is_stale(temp_name(Owner(300, "hostA")), now, now)  # dead pid, this host
    assert policy.is_stale(temp_name(me), now, now)  # ours, nothing in flight
    assert not policy.is_stale(temp_name(Owner(200, "hostA")), now, now)  # live writer
    assert not policy.is_stale(temp_name(Owner(300, "hostB")), now, now)  # another host
    assert policy.is_stale(temp_name(Owner(300, "hostB")), now - 61, now)  # ...aged out
    assert policy.is_stale(data_name(Owner(300, "hostA")), now, now)
    assert not policy.is_stale(".tmp-unknown", now, now)


def test_keeps_newest_keep_last(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=3)
    for step in range(1, 8):
        manager.save(step, make_state(step, NUMEL), blocking=step % 2 == 0)
    manager.wait()
    assert manager.steps() == [5, 6, 7]
    assert sorted(p.name for p in tmp_path.iterdir()) == [step_dir(s) for s in (5, 6, 7)]


def test_never_deletes_the_checkpoint_just_saved_after_a_rollback(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        manager.save(step, make_state(step, NUMEL))
    manager.save(15, make_state(15, NUMEL))  # resumed from an older step, e.g. 30 was bad
    manager.wait()
    assert manager.steps() == [15, 20, 30]


def test_damaged_newer_checkpoints_do_not_count(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        manager.save(step, make_state(step, NUMEL))
    (tmp_path / step_dir(3) / MANIFEST_NAME).write_bytes(b"{broken")
    manager.save(4, make_state(4, NUMEL))
    manager.wait()
    # 4 and 2 are the newest committed; damaged 3 is newer than 2 so it stays for inspection.
    assert manager.steps() == [2, 4]
    assert (tmp_path / step_dir(3)).exists()
    manager.save(5, make_state(5, NUMEL))
    manager.wait()
    assert not (tmp_path / step_dir(3)).exists()  # now older than every kept one


def test_failed_deletion_is_logged_and_training_goes_on(tmp_path):
    storage = FaultyStorage(tmp_path)
    manager = CheckpointManager(tmp_path, keep_last=2, storage=storage)
    storage.fail_removals = True
    with structlog.testing.capture_logs() as logs:
        for step in range(1, 5):
            manager.save(step, make_state(step, NUMEL), blocking=step % 2 == 1)
        manager.wait()
    failed = [e for e in logs if e["event"] == "checkpoint_delete_failed"]
    assert failed and all(e["log_level"] == "warning" and "Permission denied" in e["error"]
                          for e in failed)
    assert manager.steps() == [1, 2, 3, 4]
    storage.fail_removals = False
    manager.save(5, make_state(5, NUMEL))
    manager.wait()
    assert manager.steps() == [4, 5]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_start_cleans_leftovers_of_dead_writers_only(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(1, make_state(1, NUMEL))
    committed_files = set(os.listdir(tmp_path / step_dir(1)))
    host = Owner.current().host
    dead, live = Owner(_dead_pid(), host), Owner(os.getppid(), host)
    remote = Owner(os.getpid(), "otherhost" if host != "otherhost" else "x")
    crashed = tmp_path / step_dir(2)  # a crash before the commit: no manifest
    crashed.mkdir()
    (crashed / data_name(dead)).write_bytes(b"x" * 100)
    (crashed / temp_name(dead)).write_bytes(b"y")
    (tmp_path / step_dir(1) / temp_name(dead)).write_bytes(b"z")
    (tmp_path / step_dir(1) / data_name(dead)).write_bytes(b"superseded")
    (tmp_path / (temp_name(dead) + ".probe")).write_bytes(b"")
    (tmp_path / step_dir(9)).write_bytes(b"a file where a step directory would be")
    in_flight = tmp_path / step_dir(3)  # other writers, mid-save
    in_flight.mkdir()
    kept = {temp_name(live), temp_name(remote)}
    for name in kept:
        (in_flight / name).write_bytes(b"being written")
    abandoned = in_flight / temp_name(remote)
    abandoned.write_bytes(b"remote, abandoned")
    os.utime(abandoned, (time.time() - 7200, time.time() - 7200))

    CheckpointManager(tmp_path, keep_last=2)  # start-up cleanup

    assert not crashed.exists()
    assert set(os.listdir(tmp_path / step_dir(1))) == committed_files
    assert set(os.listdir(in_flight)) == kept
    assert sorted(os.listdir(tmp_path)) == [step_dir(1), step_dir(3), step_dir(9)]
    assert manager.load_latest().step == 1  # the stray file is not a checkpoint


def _reader(directory: str, stop, conn) -> None:
    import torch

    torch.set_num_threads(1)  # forked: libgomp's pool does not survive fork
    reader = CheckpointManager(directory, read_only=True)
    results = []
    while not stop.is_set():
        loaded = reader.load_latest()
        if loaded is not None:
            assert_same(loaded.state, make_state(loaded.step, NUMEL))
            results.append(loaded.step)
    conn.send(results)


@pytest.mark.process
def test_concurrent_saves_retention_and_a_reader(tmp_path):
    """Async saves back to back (each one's retention overlaps the next snapshot) while
    another process keeps loading: it always gets a valid checkpoint, never an error."""
    manager = CheckpointManager(tmp_path, keep_last=2)
    manager.save(0, make_state(0, NUMEL))
    ctx = multiprocessing.get_context("fork")
    stop, (parent_end, child_end) = ctx.Event(), ctx.Pipe()
    reader = ctx.Process(target=_reader, args=(str(tmp_path), stop, child_end))
    reader.start()
    try:
        for step in range(1, 60):
            manager.save(step, make_state(step, NUMEL), blocking=step % 3 == 0)
        manager.wait()
        time.sleep(0.2)
        stop.set()
        assert parent_end.poll(20), "the reader failed (see its traceback above)"
        seen = parent_end.recv()
    finally:
        stop.set()
        reader.join(10)
        if reader.is_alive():
            reader.kill()
            reader.join()
    assert reader.exitcode == 0
    assert len(seen) > 5 and seen == sorted(seen)
    assert manager.steps() == [58, 59]


def test_a_zombie_writers_temp_is_a_leftover_a_live_writers_is_not():
    """The real pid_alive (elasticd.proctree): a zombie writer can write no more."""
    import sys

    import psutil

    from elasticd import proctree

    me = Owner.current()
    policy = StalePolicy(max_age=3600, me=me)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        # Exited, not yet reaped (nothing waits for it before the finally): a zombie.
        assert proctree.wait_for(lambda: not proctree.pid_alive(zombie.pid), 10)
        assert psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE
        now = time.time()
        assert policy.is_stale(temp_name(Owner(zombie.pid, me.host)), now, now)
        assert not policy.is_stale(temp_name(Owner(live.pid, me.host)), now, now)
    finally:
        live.kill()
        live.wait()
        zombie.wait()
