"""Who is lost from the workers' world: the pure rules both in-place paths decide by.

Evidence comes in two kinds, and each has one rule:

* A peer whose record is **present** is judged by the probes. One node's failed probe is
  only its *suspicion* (``suspicions``: a refusal at once, a silence after a bound, an
  answer clears it), published in its own record; the peer is *condemned* only when a
  strict majority of the live members suspect it (``quorum.condemned``), and by nobody
  while the judging node is cut off from the majority (``quorum.isolated``). A REJECT
  cut makes refusals as certain as a crash does, so a refusal alone never fences anyone
  out (issue 29's measurement: a node behind such a cut agreed a generation without the
  two healthy nodes 0.2 s into the cut).
* A peer whose record **vanished** (its lease expired or it was deleted: etcd's majority,
  or the survivors' majority, decided) needs no votes; one probe confirms how it went
  (``departed``): a refusal is a crash, no answer a silent node, an answer a peer that
  moved on (a restart into another round: no loss), and a record that said it leaves or
  completed is a peer that left.

``loss_of`` turns those verdicts into the loss a generation is agreed on, for the nodes
of the workers' current world only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from elasticd.probe import Liveness

# A probe's answer (``probe.Liveness``'s values, the rules' plain strings), and how a lost
# peer went.
ALIVE, REFUSED, SILENT = Liveness.ALIVE.value, Liveness.REFUSED.value, Liveness.SILENT.value
LEFT, CRASHED = "left", "crashed"


@dataclass(frozen=True)
class Loss:
    """The peers lost from our workers' world, and the fault that names the re-form."""

    lost: tuple[str, ...]
    cause: str                    # peer-crashed | peer-silent | peer-left


Suspicions = dict[str, tuple[str, float]]   # node -> (crashed | silent, since)


def suspicions(answers: Mapping[str, str], members: Collection[str], prior: Mapping[str, tuple[str, float]],
               silent_since: Mapping[str, float], now: float, silent_suspect_s: float,
               ) -> tuple[Suspicions, dict[str, float]]:
    """This node's suspicions after the newest probe ``answers`` (node -> alive | refused |
    silent), and since when each unanswered peer has been silent. A refusal is a
    suspicion at once, a silence after ``silent_suspect_s``, an answer clears both; a
    peer that is not a member (no record) is no longer anyone's to judge."""
    mine = {n: v for n, v in prior.items() if n in members}
    silent = {n: t for n, t in silent_since.items() if n in members}
    for node, answer in answers.items():
        if node not in members or answer == ALIVE:
            mine.pop(node, None)
            silent.pop(node, None)
        elif answer == REFUSED:
            mine.setdefault(node, (CRASHED, now))
        elif now - silent.setdefault(node, now) >= silent_suspect_s:
            mine.setdefault(node, (SILENT, now))
    return mine, silent


def departed(gone: bool, answer: str | None) -> str | None:
    """How a peer whose record vanished went: ``left`` (its record said it leaves or
    completed), ``crashed`` (its probe is refused), ``silent`` (not answered), ``alive``
    (it answers: it moved on, no loss), or None: not known yet (probe it)."""
    if gone:
        return LEFT
    if answer == REFUSED:
        return CRASHED
    if answer == SILENT:
        return SILENT
    return ALIVE if answer == ALIVE else None


def loss_cause(hows: Iterable[str]) -> str:
    """The fault a loss is recorded as: a silent peer first (the survivors' collective
    hung on it), then a crash, then a peer that left."""
    hows = set(hows)
    for how in (SILENT, CRASHED):
        if how in hows:
            return f"peer-{how}"
    return f"peer-{LEFT}"


def loss_of(me: str, verdicts: Mapping[str, str], world: Collection[str] | None) -> Loss | None:
    """The loss to agree a generation on: every peer with a death verdict (node ->
    crashed | silent | left; ``alive`` and unknown ones are none) that is in our workers'
    ``world`` (None: not known, every peer counts), never this node."""
    dead = {n: how for n, how in verdicts.items()
            if n != me and how in (CRASHED, SILENT, LEFT) and (world is None or n in world)}
    if not dead:
        return None
    return Loss(tuple(sorted(dead)), loss_cause(dead.values()))
