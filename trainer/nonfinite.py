"""Whose loss went non-finite first: one node's NaN is that node's fault, not the job's.

DDP all-reduces gradients, so a NaN on one rank (a bit flip, a broken device, memory
that lies) poisons every rank's weights in the same step; from the next step every
rank's loss is NaN and the agreed loss (``trainer.dist.Agreement``) cannot tell who
started it. Left to ``trainer.divergence`` that is the job's divergence: every node
stops and every daemon is FAILED (issue 29, finding 9).

So every rank remembers the first step its *own* loss was not finite (``FirstBad``: on
a device the test runs there, so no step waits for the host) and the global sample span
that step consumed; a finite agreement forgets what came before it (a mixed-precision
scaler skips such a step: the weights are fine). When an agreed loss is not finite, the
ranks first agree whether the weights are (a skipped step: nothing to charge, the
divergence rule counts it), else they gather the first bad steps (the rare path) and
``judge`` decides:

* the ranks with the earliest bad step all sit on some nodes but not every node: those
  nodes are charged (``NodeUnfit``: their daemon leaves the job, journaled with the
  step), the others exit ``PeerUnfit`` (no crash counted; the next round forms without
  the culprit and resumes the last checkpoint: the poisoned weights are never kept);
* every node went bad at the same step, or no rank can say: the model diverged, as
  before (``DivergenceCheck`` counts it);
* the culprit's step consumed samples that already made *another* node's loss
  non-finite (the span a survivor recorded, ``Suspects``): the data is bad, not the
  node. Charging again would evict one node per replay of that sample until none is
  left, so it is ``TrainingDiverged`` with the samples named.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import structlog
import torch

from elasticd.contract.files import write_atomic
from trainer.errors import TrainingDiverged
from trainer.fitness import NodeUnfit, PeerUnfit, Report, gather

log = structlog.get_logger(__name__)

NONE = -1  # no bad step seen
# Steps whose spans are kept: the agreement reads a step at most MAX_AGREE_EVERY (1000)
# steps after the previous one, so the first bad step is always within this window.
SPAN_WINDOW = 4096
DEVICE_FIX = ("check this node's accelerator and memory (nvidia-smi -q for ECC/Xid errors, "
              "dmesg, a memory test) before it rejoins")


@dataclass(frozen=True)
class Span:
    """The global sample positions one step consumed: ``[start, end)`` of ``epoch``."""

    epoch: int
    start: int
    end: int

    def overlaps(self, other: Span) -> bool:
        return self.epoch == other.epoch and self.start < other.end and other.start < self.end

    def __str__(self) -> str:
        return f"samples {self.start}..{self.end - 1} of epoch {self.epoch}"


def sampler_span(sampler: object, before: tuple[int, int] | None) -> Span | None:
    """The span of the step that moved ``sampler`` from ``before`` (epoch, cursor) to its
    position now; None for a sampler without a global cursor (or a step across epochs)."""
    now = position(sampler)
    if before is None or now is None:
        return None
    (e0, c0), (e1, c1) = before, now
    if e1 == e0:
        return Span(e0, c0, c1)
    return Span(e0, c0, getattr(sampler, "dataset_len", c0)) if c1 == 0 and e1 == e0 + 1 else None


def position(sampler: object) -> tuple[int, int] | None:
    """(epoch, cursor) of a sampler with a global cursor (``trainer.sampler``), else None."""
    epoch, cursor = getattr(sampler, "epoch", None), getattr(sampler, "cursor", None)
    return (epoch, cursor) if isinstance(epoch, int) and isinstance(cursor, int) else None


class FirstBad:
    """This rank's first step whose own loss was not finite, and each recent step's span."""

    def __init__(self) -> None:
        self._host: int = NONE
        self._device: torch.Tensor | None = None  # the same, kept on the loss' device
        self.spans: collections.OrderedDict[int, Span | None] = collections.OrderedDict()

    def note(self, step: int, loss: float | torch.Tensor | None, span: Span | None) -> None:
        """Step ``step`` ended with this rank's ``loss`` (None: not given) over ``span``."""
        self.spans[step] = span
        if len(self.spans) > SPAN_WINDOW:
            self.spans.popitem(last=False)
        if loss is None or self._host != NONE:
            return
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if isinstance(loss, torch.Tensor) and loss.device.type != "cpu":
            # No .item(): it would wait for the step queued behind this one.
            bad = ~torch.isfinite(loss.reshape(()))
            first = self._device if self._device is not None else torch.full(
                (), NONE, dtype=torch.int64, device=loss.device)
            self._device = torch.where(bad & (first == NONE), step, first)
        elif not math.isfinite(float(loss)):
            self._host = step

    def forget_through(self, step: int) -> None:
        """The agreed loss of ``step`` was finite: a bad step up to it did not poison the
        weights (a scaler skipped it), so it charges nobody later."""
        if self._host != NONE and self._host <= step:
            self._host = NONE
        if self._device is not None:
            self._device = torch.where(self._device <= step, NONE, self._device)

    def first(self) -> int:
        """The first bad step (NONE: none); reads the device copy (the rare path only)."""
        if self._host == NONE and self._device is not None:
            self._host = int(self._device.item())
        return self._host

    def span(self, step: int) -> Span | None:
        return self.spans.get(step)


class Suspects:
    """Spans whose samples made some node's loss non-finite, kept beside the progress
    file so that the workers the agent restarts next still know them. Without a progress
    file (plain torchrun, no daemon) they live only as long as this process, which exits
    after a charge: there the guard is off and bad data costs a node per replay."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._spans: list[Span] = []

    def load(self) -> list[Span]:
        if self.path is None:
            return self._spans
        try:
            with open(self.path, encoding="utf-8") as f:
                raw = json.load(f)
            return [Span(int(s["epoch"]), int(s["start"]), int(s["end"])) for s in raw]
        except (OSError, ValueError, TypeError, KeyError):
            return []  # none yet, or not ours to trust: a missing guard, never a crash

    def add(self, span: Span) -> None:
        spans = [*self.load(), span][-64:]
        self._spans = spans
        if self.path is not None:
            write_atomic(self.path, json.dumps([asdict(s) for s in spans]))

    def covers(self, span: Span | None) -> bool:
        spans = self.load()
        return bool(spans) if span is None else any(span.overlaps(s) for s in spans)


@dataclass(frozen=True)
class Verdict:
    """What the gathered first bad steps say: the culprit nodes (empty: the job's own
    divergence), the step they went bad at."""

    culprits: frozenset[int]
    step: int


def judge(reports: Sequence[Report]) -> Verdict:
    """The nodes whose ranks went bad first, unless that is every node (or none can say)."""
    bad = [r for r in reports if r.value != NONE]
    if not bad:
        return Verdict(frozenset(), NONE)
    step = min(r.value for r in bad)
    culprits = frozenset(r.node for r in bad if r.value == step)
    every = {r.node for r in reports}
    return Verdict(frozenset() if culprits == every else culprits, step)


def attribute(node: int, first_bad: FirstBad, suspects: Suspects, model: torch.nn.Module,
              device: torch.device, collective: Callable[[str, Callable], None],
              is_local_rank0: bool) -> None:
    """An agreed loss was not finite: every rank calls this (the agreement is the same
    everywhere, so every rank takes the same collectives). Returns when nothing is
    poisoned or it is the job's divergence; raises NodeUnfit on the culprit's ranks,
    PeerUnfit on the others', TrainingDiverged on all when the culprit's samples were
    already suspect."""
    # Agreed, not decided alone: a rank whose check differed would leave its peers
    # waiting in the next gather.
    poisoned = gather(node, 0 if weights_finite(model) else 1, device, collective)
    if not any(r.value for r in poisoned):
        return
    verdict = judge(gather(node, first_bad.first(), device, collective))
    if not verdict.culprits:
        return
    span = first_bad.span(verdict.step)
    # Every rank asks its own record (a joiner has none); one flag is enough for all.
    seen = gather(node, 1 if suspects.covers(span) else 0, device, collective)
    where = str(span) if span is not None else "samples this process cannot name"
    if any(r.value for r in seen):
        raise TrainingDiverged(
            f"the loss went non-finite on node(s) with first rank {sorted(verdict.culprits)} "
            f"at step {verdict.step} ({where}), samples that already made another node's "
            "loss non-finite: the data, not a node, is at fault (evicting nodes would lose "
            "one per replay). Fix: remove or repair those samples (or lower the LR), then "
            "restart the job")
    if node in verdict.culprits:
        raise NodeUnfit(
            f"this node (ranks from {node}) computed a non-finite loss at step "
            f"{verdict.step} ({where}) while every other node's was finite: a fault of this "
            f"node, not of the model. Fix: {DEVICE_FIX}; the other nodes go on without it")
    if is_local_rank0 and span is not None:
        suspects.add(span)
    log.warning("a peer's loss went non-finite first; restarting without it from the last "
                "checkpoint", culprits=sorted(verdict.culprits), step=verdict.step, span=where)
    raise PeerUnfit(f"the node(s) with first rank {sorted(verdict.culprits)} computed a "
                    f"non-finite loss at step {verdict.step} ({where}) first; their daemons "
                    "leave the job, restarting without them from the last checkpoint")


def weights_finite(model: torch.nn.Module) -> bool:
    """Every floating parameter of ``model`` finite, checked before each save.

    A sum per parameter (a NaN or inf anywhere makes it non-finite): 30 ms for 100M
    float32 parameters on this machine's CPU, where ``isfinite(p).all()`` took 430 ms;
    one host read per device. Summed in float32 (float64 for float64 parameters), so
    half-precision weights cannot overflow the check."""
    sums = [p.detach().sum(dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
            for p in model.parameters() if p.is_floating_point()]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for total in sums:
        by_device.setdefault(total.device, []).append(total.to(torch.float64))
    return all(bool(torch.isfinite(torch.stack(group)).all()) for group in by_device.values())


__all__ = ["NONE", "FirstBad", "Span", "Suspects", "Verdict", "attribute", "judge",
           "position", "sampler_span", "weights_finite"]
