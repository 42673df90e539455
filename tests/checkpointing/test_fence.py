"""Generation fence: once a newer world raised the directory's fence, an older writer never
commits (real files; a real SIGSTOPped trainer under torchrun)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from checkpointing import CheckpointManager, StaleGenerationError, _hooks
from checkpointing.fence import FENCE_NAME, Generation, raise_fence, read_fence
from checkpointing.storage import LocalStorage
from tests.trainer.launch import Launch


def _state(step: int) -> dict:
    return {"w": torch.full((8,), float(step))}


def _fence(directory) -> dict:
    return json.loads((directory / FENCE_NAME).read_text())


def _manifests(directory) -> dict[int, dict]:
    return {int(p.parent.name.split("-")[1]): json.loads(p.read_text())
            for p in directory.glob("step-*/manifest.json")}


def test_a_newer_generation_fences_out_the_older_writer(tmp_path):
    old = CheckpointManager(tmp_path, generation=3, generation_epoch="e")
    old.save(1, _state(1))
    # Two managers in one process: a manager's cleanup takes this pid's temps for its own
    # leftovers, so its background retention must be done before the other one writes.
    old.wait()
    assert _fence(tmp_path) == {"generation": 3, "epoch": "e", "seq": 0}
    CheckpointManager(tmp_path, generation=4, generation_epoch="e")
    assert _fence(tmp_path) == {"generation": 4, "epoch": "e", "seq": 0}

    with pytest.raises(StaleGenerationError, match=r"generation 3 .*fence is at generation 4") as err:
        old.save(2, _state(2))
    assert (err.value.generation, err.value.fence) == (Generation(3, "e"), Generation(4, "e"))
    old.save(3, _state(3), blocking=False)     # a background save is refused the same way
    with pytest.raises(StaleGenerationError):
        old.wait()
    assert list(_manifests(tmp_path)) == [1]   # nothing of the stale writer after the fence
    reader = CheckpointManager(tmp_path, read_only=True)
    assert reader.latest_step() == 1
    assert reader.load_latest().manifest.generation == 3


def test_the_fence_never_goes_down(tmp_path):
    CheckpointManager(tmp_path, generation=5, generation_epoch="e")
    with pytest.raises(StaleGenerationError, match="opening"):
        CheckpointManager(tmp_path, generation=4, generation_epoch="e")
    assert _fence(tmp_path)["generation"] == 5
    same = CheckpointManager(tmp_path, generation=5, generation_epoch="e")  # two writers of 5
    same.save(7, _state(7))
    assert _fence(tmp_path)["generation"] == 5
    assert _manifests(tmp_path)[7]["generation"] == 5


def test_a_fence_lowered_by_a_race_is_raised_again_at_the_next_commit(tmp_path):
    owner = CheckpointManager(tmp_path, generation=6, generation_epoch="e")
    (tmp_path / FENCE_NAME).write_text('{"generation": 2, "epoch": "e"}')  # a racing opener
    owner.save(1, _state(1))
    assert _fence(tmp_path)["generation"] == 6


def test_another_epoch_replaces_the_fence_and_fences_out_the_old_epoch(tmp_path):
    # A rendezvous state created anew (lease expired, fresh etcd) starts again at round 0.
    old = CheckpointManager(tmp_path, generation=9, generation_epoch="before")
    new = CheckpointManager(tmp_path, generation=0, generation_epoch="after")
    assert _fence(tmp_path) == {"generation": 0, "epoch": "after", "seq": 0}
    new.save(1, _state(1))
    new.wait()
    with pytest.raises(StaleGenerationError):
        old.save(2, _state(2))
    assert list(_manifests(tmp_path)) == [1]


def test_a_manager_without_generation_neither_reads_nor_writes_the_fence(tmp_path):
    plain = CheckpointManager(tmp_path)
    plain.save(1, _state(1))
    plain.wait()
    assert not (tmp_path / FENCE_NAME).exists()
    assert "generation" not in _manifests(tmp_path)[1]
    assert plain.load_latest().manifest.generation is None
    CheckpointManager(tmp_path, generation=8)          # a fenced world arrives
    plain.save(2, _state(2))                            # unfenced writers are not checked
    assert sorted(_manifests(tmp_path)) == [1, 2]
    # read_only managers never touch the fence, whatever their generation
    CheckpointManager(tmp_path, read_only=True, generation=99)
    assert _fence(tmp_path)["generation"] == 8


def test_a_malformed_fence_is_replaced_by_the_next_opener(tmp_path):
    (tmp_path / FENCE_NAME).write_text("not json")
    CheckpointManager(tmp_path, generation=2).save(1, _state(1))
    assert _fence(tmp_path) == {"generation": 2, "epoch": None, "seq": 0}


def test_bad_generations_are_config_errors(tmp_path):
    for bad in (-1, True, "3"):
        with pytest.raises(ValueError, match="generation"):
            CheckpointManager(tmp_path, generation=bad)


def test_a_commit_whose_check_was_overtaken_is_taken_back(tmp_path, monkeypatch):
    """The writer pauses between its fence check and the manifest's rename while a newer
    world raises the fence: the re-check after the rename removes its manifest."""
    old = CheckpointManager(tmp_path, generation=3, generation_epoch="e")
    old.save(1, _state(1))

    def newer_world_arrives(phase: str, path: str) -> None:
        if phase == "checkpoint.fence_checked" and path.endswith("000000002"):
            # What the newer world's rank 0 does on another host (a manager in this process
            # would also clean this pid's files as its own leftovers).
            raise_fence(LocalStorage(tmp_path), Generation(4, "e"))

    monkeypatch.setattr(_hooks, "phase_hook", newer_world_arrives)
    with pytest.raises(StaleGenerationError):
        old.save(2, _state(2))
    assert list(_manifests(tmp_path)) == [1]
    assert list((tmp_path / "step-000000002").iterdir()) == []  # its data file went too
    assert read_fence(LocalStorage(tmp_path)) == Generation(4, "e")


@pytest.mark.process
def test_a_sigstopped_trainer_woken_after_a_newer_generation_cannot_commit(tmp_path):
    """Real processes: rank 0 of generation 3 (torchrun, the real ElasticTrainer) saves
    every 5 steps; it is SIGSTOPped, a generation-4 writer raises the fence and commits,
    then the stale worker is woken. Its next save is refused and it exits 1."""
    ckpt = tmp_path / "ckpt"
    stale = Launch(tmp_path, "stale", 1, [
        "--max-steps", "100000", "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "5",
        "--step-sleep", "0.02"], env={"ELASTICD_GENERATION": "3", "ELASTICD_GENERATION_EPOCH": "e"})
    try:
        stale.start()
        stale.wait_step(12, timeout_s=90)
        worker = stale.workers()[0]
        worker.send_signal(signal.SIGSTOP)
        time.sleep(0.3)   # let nothing be half-written but what the pause caught
        before = _manifests(ckpt)
        assert before and {m["generation"] for m in before.values()} == {3}

        newer = CheckpointManager(ckpt, generation=4, generation_epoch="e")
        resumed_at = max(before)
        newer.save(resumed_at + 1, _state(0))
        worker.send_signal(signal.SIGCONT)
        code = stale.wait(timeout_s=60)
    finally:
        stale.kill()
    assert code != 0, stale.tail()
    exits = stale.exits()
    assert exits[0]["exit_code"] == 1, stale.tail()
    stale_lines = [r for r in stale.records() if r.get("event", "").startswith("stale worker")]
    assert stale_lines and stale_lines[0]["fence"] == "4 (epoch e)", stale.tail()
    assert any(r.get("event") == "checkpoint_refused_stale_generation" for r in stale.records())
    after = _manifests(ckpt)
    # Nothing committed by generation 3 after the fence went up (retention may have
    # deleted older ones), and the newest checkpoint is the generation-4 one.
    assert {s for s, m in after.items() if m["generation"] == 3} <= set(before)
    assert max(after) == resumed_at + 1 and after[max(after)]["generation"] == 4
    assert exits[0]["step"] > resumed_at   # it did train on, and tried to save, after waking


def test_an_in_place_re_form_fences_out_the_world_it_left(tmp_path):
    """Re-form 1 of round 3 is newer than round 3 as torchrun formed it, older than round 4."""
    old = CheckpointManager(tmp_path, generation=3, generation_epoch="e")
    old.save(1, _state(1))
    old.wait()
    survivor = CheckpointManager(tmp_path, generation=3, generation_epoch="e", generation_seq=1)
    assert _fence(tmp_path) == {"generation": 3, "epoch": "e", "seq": 1}
    with pytest.raises(StaleGenerationError, match=r"generation 3 .*fence is at generation 3\.1"):
        old.save(2, _state(2))
    survivor.save(2, _state(2))
    survivor.wait()
    CheckpointManager(tmp_path, generation=4, generation_epoch="e")   # the next torchrun round
    with pytest.raises(StaleGenerationError, match=r"generation 3\.1 .*fence is at generation 4"):
        survivor.save(3, _state(3))
    assert sorted(_manifests(tmp_path)) == [1, 2]


def test_a_writer_that_re_formed_raises_the_fence_and_keeps_committing(tmp_path):
    writer = CheckpointManager(tmp_path, generation=2, generation_epoch="e")
    writer.save(1, _state(1), blocking=False)   # in flight while the group re-forms
    writer.advance_generation(1)
    writer.wait()
    assert _fence(tmp_path) == {"generation": 2, "epoch": "e", "seq": 1}
    writer.save(2, _state(2))
    with pytest.raises(StaleGenerationError, match="opening"):
        CheckpointManager(tmp_path, generation=2, generation_epoch="e")   # the world it left
    assert sorted(_manifests(tmp_path)) == [1, 2]


def test_a_fence_written_before_re_forms_existed_reads_as_seq_0(tmp_path):
    (tmp_path / FENCE_NAME).write_text('{"generation": 2, "epoch": "e"}')
    assert read_fence(LocalStorage(tmp_path)) == Generation(2, "e", 0)
