"""Faults under real torchrun: a peer crash, the daemon's stop file, a SIGKILLed agent."""

from __future__ import annotations

import math
import signal

import pytest

from checkpointing import CheckpointManager
from tests.trainer.launch import Launch, wait_gone
from trainer.exitcodes import DIVERGED_EXIT_CODE, FAILURE_EXIT_CODE, STOP_EXIT_CODE

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process


def _args(ckpt, *extra: str) -> list[str]:
    return ["--samples=512", "--batch-size=8", f"--checkpoint-dir={ckpt}",
            "--max-steps=100000", "--step-sleep=0.02", *extra]


def test_peer_crash_rank0_commits_the_last_completed_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    launch = Launch(tmp_path, "crash", 2, _args(ckpt, "--checkpoint-every-steps=1000")).start()
    try:
        launch.wait_step(6)
        launch.signal_worker(1, signal.SIGKILL)
        assert launch.wait(60) != 0
    finally:
        launch.kill()
    last_logged = max(e["step"] for e in launch.events())
    exits = launch.exits()
    assert exits[0]["exit_code"] == FAILURE_EXIT_CODE
    saved = CheckpointManager(ckpt, read_only=True).load_latest()
    # The survivor keeps every step it completed: nothing logged is lost.
    assert saved is not None and saved.step >= last_logged
    assert saved.manifest.metadata["reason"] == "failure"


def test_stop_file_drains_like_sigterm(tmp_path):
    ckpt, stop = tmp_path / "ckpt", tmp_path / "stop"
    launch = Launch(tmp_path, "drain", 2, _args(ckpt, f"--stop-file={stop}")).start()
    try:
        launch.wait_step(3)
        stop.touch()
        assert launch.wait(60) != 0
    finally:
        launch.kill()
    stopped = launch.events()[-1]
    assert stopped["event"] == "stopped" and stopped["stop_reason"].startswith("stop file")
    assert {e["exit_code"] for e in launch.exits().values()} == {STOP_EXIT_CODE}
    assert CheckpointManager(ckpt, read_only=True).latest_step() == stopped["step"]


def test_sigkilled_agent_leaves_no_workers(tmp_path):
    launch = Launch(tmp_path, "orphans", 2, _args(tmp_path / "ckpt")).start()
    try:
        launch.wait_step(2)
        workers = launch.workers()
        assert len(workers) == 2
        launch.proc.kill()  # the agent only: its workers live in their own sessions
        launch.proc.wait()
        assert wait_gone(workers, 3.0) < 2.0  # the watchdog polls every 0.25 s
    finally:
        launch.kill()


def test_a_diverging_loss_stops_every_worker_without_committing_it(tmp_path):
    """An LR of 1e6 sends the loss to inf/NaN within a few steps: after 3 agreed
    non-finite losses every worker reports ``diverged`` and exits 65, and no checkpoint
    is started once a non-finite loss was agreed (a resume would load diverged weights)."""
    ckpt = tmp_path / "ckpt"
    launch = Launch(tmp_path, "diverge", 2, _args(ckpt, "--lr=1e6", "--checkpoint-every-steps=1"))
    assert launch.run(90) != 0
    events = launch.events()
    assert {e["exit_code"] for e in launch.exits().values()} == {DIVERGED_EXIT_CODE}
    assert events[-1]["event"] == "diverged" and "lower the" in events[-1]["reason"]
    first_bad = next(i for i, e in enumerate(events)
                     if e.get("loss") is not None and not math.isfinite(e["loss"]))
    assert [e["step"] for e in events[first_bad:] if e["event"] == "checkpoint"] == []
    latest = CheckpointManager(ckpt, read_only=True).latest_step()
    assert latest is not None and latest < events[first_bad]["step"]
