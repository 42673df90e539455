"""``trainer.nonfinite``: whose loss went non-finite first decides whose fault it is.

The rules on their own (``judge``, spans, the suspects file, the first bad step kept
without a host read), then ``attribute`` in a real gloo group of three processes: a
node whose rank went bad a step before the others is charged (``NodeUnfit`` naming the
step, the samples and the fix), the others are told (``PeerUnfit``) and record the
samples; every node bad at once is the job's divergence; samples already suspect make
it the data's fault on every rank (``TrainingDiverged``), a joiner without the record
included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticd.lab.embedded_etcd import free_port
from tests.trainer.launch import run_members
from trainer.fitness import Report
from trainer.nonfinite import (
    NONE,
    FirstBad,
    Span,
    Suspects,
    judge,
    sampler_span,
    weights_finite,
)
from trainer.sampler import ElasticSampler

MEMBER = str(Path(__file__).resolve().parents[1] / "workers" / "nonfinite_member.py")


def test_the_earliest_bad_nodes_are_the_culprits_unless_that_is_every_node():
    # ranks 0,1 on node 0; 2,3 on node 2; 4 on node 4
    reports = [Report(0, 9), Report(0, NONE), Report(2, 8), Report(2, 9), Report(4, 9)]
    assert judge(reports).culprits == {2} and judge(reports).step == 8
    everyone = [Report(0, 9), Report(2, 9), Report(4, 9)]
    assert judge(everyone).culprits == frozenset()
    assert judge([Report(0, NONE), Report(2, NONE)]).culprits == frozenset()
    assert judge([Report(0, 5), Report(2, 5), Report(4, 6)]).culprits == {0, 2}


def test_a_step_span_comes_from_the_global_cursor_and_rolls_over_with_the_epoch():
    sampler = ElasticSampler(10, seed=1)
    sampler.advance(4)
    before = (sampler.epoch, sampler.cursor)
    sampler.advance(6)  # the epoch's last, short step
    assert sampler_span(sampler, before) == Span(0, 4, 10)
    before = (sampler.epoch, sampler.cursor)
    sampler.advance(3)
    assert sampler_span(sampler, before) == Span(1, 0, 3)
    assert sampler_span(object(), before) is None
    assert Span(0, 4, 10).overlaps(Span(0, 9, 12)) and not Span(0, 4, 10).overlaps(Span(0, 10, 12))
    assert not Span(0, 4, 10).overlaps(Span(1, 4, 10))


def test_the_first_bad_step_is_kept_until_a_finite_agreement_after_it():
    seen = FirstBad()
    seen.note(1, 0.5, Span(0, 0, 4))
    seen.note(2, None, Span(0, 4, 8))  # no loss given: nothing to say
    assert seen.first() == NONE
    seen.note(3, torch.tensor(float("inf")), Span(0, 8, 12))
    seen.note(4, float("nan"), Span(0, 12, 16))
    assert seen.first() == 3 and seen.span(3) == Span(0, 8, 12)
    seen.forget_through(2)  # an agreement of an earlier step says nothing about step 3
    assert seen.first() == 3
    seen.forget_through(5)  # finite after it: a skipped step, forgotten
    assert seen.first() == NONE
    seen.note(6, float("nan"), None)
    assert seen.first() == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_device_the_first_bad_step_is_kept_without_a_host_read():
    seen = FirstBad()
    seen.note(1, torch.tensor(1.0, device="cuda"), None)
    seen.note(2, torch.tensor(float("nan"), device="cuda"), None)
    seen.note(3, torch.tensor(float("nan"), device="cuda"), None)
    seen.forget_through(1)
    assert seen.first() == 2
    seen.forget_through(3)
    assert seen.first() == NONE


def test_suspects_survive_the_process_in_their_file_and_garbage_is_no_record(tmp_path):
    path = tmp_path / "progress.json.nonfinite"
    Suspects(str(path)).add(Span(2, 10, 20))
    assert Suspects(str(path)).covers(Span(2, 15, 16))
    assert not Suspects(str(path)).covers(Span(2, 20, 30))
    path.write_text('{"not": "a list"}')
    assert not Suspects(str(path)).covers(Span(2, 15, 16))


def test_weights_with_a_nan_are_not_finite():
    model = torch.nn.Linear(3, 2)
    assert weights_finite(model)
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    assert not weights_finite(model)


def _run(firsts: list[int], suspects: list[Path | None], weights: str = "nan") -> list[dict]:
    """One member per node (ranks 0..n-1); rank r's own loss first bad at firsts[r];
    ``weights`` nan: every rank's weights hold a NaN (ok: finite, a skipped step)."""
    port = free_port()
    return run_members(MEMBER, [[str(r), str(len(firsts)), str(port), str(r), str(f),
                                 str(s) if s else "-", weights]
                                for r, (f, s) in enumerate(zip(firsts, suspects, strict=True))])


@pytest.mark.process
def test_the_node_that_went_bad_first_is_charged_and_the_others_record_the_samples(tmp_path):
    files = [tmp_path / f"n{r}.nonfinite" for r in range(3)]
    out = _run([8, 9, 9], list(files))
    assert [o["outcome"] for o in out] == ["NodeUnfit", "PeerUnfit", "PeerUnfit"]
    culprit = out[0]["message"]
    assert "non-finite loss at step 8" in culprit and "samples 84..95 of epoch 0" in culprit
    assert "Fix: check this node's accelerator" in culprit
    assert not files[0].exists()  # the culprit records nothing
    assert Suspects(str(files[1])).covers(Span(0, 90, 91)) and files[2].exists()


@pytest.mark.process
def test_a_nan_everywhere_at_once_is_the_jobs_divergence(tmp_path):
    out = _run([9, 9, 9], [None] * 3)
    assert {o["outcome"] for o in out} == {"returned"}  # DivergenceCheck counts it
    assert {o["outcome"] for o in _run([NONE] * 3, [None] * 3)} == {"returned"}


@pytest.mark.process
def test_a_bad_loss_whose_weights_stayed_finite_charges_nobody(tmp_path):
    # A mixed-precision scaler skipped the step: the weights are fine, nobody is at fault.
    files = [tmp_path / f"n{r}.nonfinite" for r in range(3)]
    assert {o["outcome"] for o in _run([8, 9, 9], list(files), weights="ok")} == {"returned"}
    assert not any(f.exists() for f in files)


@pytest.mark.process
def test_samples_that_already_made_a_node_unfit_are_the_datas_fault_on_every_rank(tmp_path):
    survivor = tmp_path / "n1.nonfinite"
    Suspects(str(survivor)).add(Span(0, 84, 96))  # recorded when another node was charged
    out = _run([9, 8, 9], [None, survivor, None])  # rank 0 and 2: joiners without a record
    assert {o["outcome"] for o in out} == {"TrainingDiverged"}
    assert "the data, not a node, is at fault" in out[0]["message"]
    assert "at step 8 (samples 84..95 of epoch 0)" in out[0]["message"]
