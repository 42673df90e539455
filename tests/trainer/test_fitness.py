"""``trainer.fitness`` in a real gloo group of three processes, each rank reading its own
real checkpoint directory: a node whose directory lacks the job's newest commit is
charged with it (``NodeUnfit``, naming the directory, both steps and the fix), the others
are told it is a peer's (``PeerUnfit``), and a commit that appears late (a network
filesystem's attribute cache) is waited for."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from checkpointing import CheckpointManager
from elasticd.lab.embedded_etcd import free_port
from tests.trainer.launch import run_members
from trainer import fitness

MEMBER = str(Path(__file__).resolve().parents[1] / "workers" / "fitness_member.py")


def _commit(directory: Path, *steps: int) -> None:
    manager = CheckpointManager(directory, world_size=1)
    for step in steps:
        manager.save(step, {"w": torch.full((4,), float(step))})
    manager.wait()


def _run(dirs: list[Path], fail_load: int | None = None) -> list[dict]:
    """One member per directory (ranks 0..n-1, one node each); their outcomes by rank;
    rank ``fail_load``'s load of the agreed step fails."""
    port = free_port()
    return run_members(MEMBER, [[str(r), str(len(dirs)), str(port), str(r), str(d),
                                 "fail-load" if r == fail_load else "-"]
                                for r, d in enumerate(dirs)])


@pytest.mark.process
def test_a_node_without_the_newest_checkpoint_is_charged_and_its_peers_are_told(tmp_path):
    shared, mount = tmp_path / "shared", tmp_path / "failed-mount"
    _commit(shared, 10, 20)
    mount.mkdir()
    started = time.monotonic()
    a, b, c = _run([shared, shared, mount])
    assert c["error"] == "NodeUnfit"
    assert str(mount) in c["message"] and "no checkpoint" in c["message"]
    assert "step 20" in c["message"] and "Fix: mount the job's shared checkpoint" in c["message"]
    for peer in (a, b):
        assert peer["error"] == "PeerUnfit" and "first rank [2]" in peer["message"]
    assert time.monotonic() - started >= fitness.VISIBLE_S  # it waited for the commit


@pytest.mark.process
def test_an_older_copy_is_unfit_too(tmp_path):
    shared, stale = tmp_path / "shared", tmp_path / "stale"
    _commit(shared, 10, 20)
    _commit(stale, 10)
    a, b = _run([stale, shared])
    assert a["error"] == "NodeUnfit" and "shows step 10" in a["message"]
    assert b["error"] == "PeerUnfit"


@pytest.mark.process
def test_a_commit_that_appears_late_is_waited_for(tmp_path):
    shared, lagging = tmp_path / "shared", tmp_path / "lagging"
    _commit(shared, 10, 20)
    _commit(lagging, 10)

    def appears() -> None:  # as a lagging attribute cache would show it, 2 s late
        time.sleep(2.0)
        tmp = tmp_path / "copy"
        shutil.copytree(shared, tmp)
        shutil.rmtree(lagging)
        tmp.rename(lagging)

    late = threading.Thread(target=appears)
    late.start()
    try:
        outcomes = _run([shared, lagging, shared])
    finally:
        late.join()
    assert outcomes == [{"newest": 20}] * 3


@pytest.mark.process
def test_a_fresh_job_and_a_healthy_one_agree_at_once(tmp_path):
    empty, shared = tmp_path / "empty", tmp_path / "shared"
    empty.mkdir()
    assert _run([empty, empty]) == [{"newest": fitness.NONE}] * 2
    _commit(shared, 7)
    assert _run([shared, shared, shared]) == [{"newest": 7}] * 3


@pytest.mark.process
def test_a_load_that_fails_on_one_node_is_that_nodes_fault(tmp_path):
    shared = tmp_path / "shared"
    _commit(shared, 7)
    a, b, c = _run([shared, shared, shared], fail_load=1)
    assert b["error"] == "NodeUnfit" and "could not load checkpoint step 7" in b["message"]
    assert "Input/output error" in b["message"] and "the same mount" in b["message"]
    assert a["error"] == c["error"] == "PeerUnfit"


def test_unfit_nodes_are_those_with_a_rank_below_the_newest():
    reports = [fitness.Report(0, 20), fitness.Report(0, 20), fitness.Report(2, 20),
               fitness.Report(2, 10), fitness.Report(4, 20)]
    assert fitness.unfit_nodes(reports, 20) == {2}
    assert fitness.unfit_nodes(reports, 10) == set()
