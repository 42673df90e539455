"""Progress file: the contract's keys, atomically rewritten, only on local rank 0."""

from __future__ import annotations

import json

import pytest

from elasticd.contract.files import write_atomic
from trainer.context import ElasticContext
from trainer.progress import ProgressReporter

KEYS = {"step", "world_size", "rank", "lr", "loss", "time", "restart_count", "run_id", "event"}


def _ctx(tmp_path, local_rank=0):
    return ElasticContext(rank=local_rank, local_rank=local_rank, world_size=2,
                          restart_count=2, run_id="r1", progress_file=str(tmp_path / "p.json"))


def test_record_has_the_contract_keys(tmp_path):
    reporter = ProgressReporter(_ctx(tmp_path), wall_clock=lambda: 123.5)
    reporter.report("step", 7, lr=0.1, loss=0.25)
    rec = json.loads((tmp_path / "p.json").read_text())
    assert rec.keys() >= KEYS
    assert (rec["event"], rec["step"], rec["world_size"], rec["lr"], rec["loss"]) == (
        "step", 7, 2, 0.1, 0.25)
    assert (rec["time"], rec["restart_count"], rec["run_id"]) == (123.5, 2, "r1")


def test_only_local_rank0_writes(tmp_path):
    ProgressReporter(_ctx(tmp_path, local_rank=1)).report("step", 1)
    assert not (tmp_path / "p.json").exists()


def test_unknown_event_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown progress event"):
        ProgressReporter(_ctx(tmp_path)).report("exploded", 1)


def test_write_atomic_leaves_no_temp_file(tmp_path):
    path = tmp_path / "f.json"
    write_atomic(str(path), "{}")
    write_atomic(str(path), '{"a": 1}')
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_steps_per_second_uses_the_monotonic_clock(tmp_path):
    now = [0.0]
    reporter = ProgressReporter(_ctx(tmp_path), log_every=10, clock=lambda: now[0])
    reporter.report("step", 10)
    now[0] = 2.0
    reporter.report("step", 20)
    assert reporter.steps_per_s == 5.0
