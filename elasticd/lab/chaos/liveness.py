"""The liveness invariant: no single node can stall the job (issue 29).

Whenever at least ``min_nodes`` nodes have been in the job, live, unfrozen and connected,
for longer than ``bound_s`` (the lease TTL plus the restart bound: what detecting a lost
member and forming the next world may take), the job steps. Checked on what a run left
behind: the times of the job's step records and, per node, when it was out (killed,
frozen, drained, cut off) by the faults that were sent. One definition for the chaos
harness (``invariants.check_liveness``) and the goodput benchmark.

Pure functions: ``tests/chaos/test_liveness.py`` feeds them stalls to show they bite.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# The lease TTL is the chaos harness' and the benchmarks' 5 s; the restart bound covers a
# released agent's restart, the next round and the resume on a loaded 2-core machine
# (measured 7.3 s beyond the lease in tests/daemon/test_round_liveness.py).
RESTART_BOUND_S = 15.0
GAP_S = 1.0  # a gap between step records longer than this is a pause (records: >= 4 a second)


@dataclass(frozen=True)
class Pause:
    """The job did not step from ``start`` for ``length_s`` (to the next step, or the end)."""

    start: float
    length_s: float

    @property
    def end(self) -> float:
        return self.start + self.length_s


@dataclass(frozen=True)
class Violation:
    """From ``start`` for ``length_s`` the job did not step although ``nodes`` had been in
    it, live and connected, for longer than the bound."""

    start: float
    length_s: float
    nodes: tuple[str, ...]


def pauses(step_times: Iterable[float], t0: float, t1: float, gap_s: float = GAP_S) -> list[Pause]:
    """The gaps of more than ``gap_s`` between step records inside ``[t0, t1]`` (one that
    runs past ``t1`` is cut there; so is the gap from ``t0`` to the first step)."""
    steps = sorted(t for t in step_times if t0 <= t <= t1)
    edges = [t0, *steps, t1]
    return [Pause(a, round(b - a, 3)) for a, b in zip(edges, edges[1:], strict=False)
            if b - a > gap_s]


def longest(found: Sequence[Pause]) -> Pause | None:
    return max(found, key=lambda p: p.length_s, default=None)


def settled_at(out: Mapping[str, Sequence[tuple[float, float]]], nodes: Iterable[str],
               t: float, bound_s: float) -> tuple[str, ...]:
    """The nodes that at ``t`` have been in the job, not out, for longer than ``bound_s``
    (``out[node]``: the ``[from, to)`` intervals it was out, ``to`` = inf for good; a node
    with no interval started before the run)."""
    return tuple(n for n in sorted(nodes)
                 if all(to <= t - bound_s or start > t for start, to in out.get(n, ())))


def violations(step_times: Iterable[float], out: Mapping[str, Sequence[tuple[float, float]]],
               nodes: Iterable[str], t0: float, t1: float, min_nodes: int,
               bound_s: float) -> list[Violation]:
    """Each stretch of a pause during which at least ``min_nodes`` nodes were settled
    (``settled_at``) for the whole of the last ``bound_s``: the job owed a step then."""
    names = sorted(nodes)
    found = []
    for pause in pauses(step_times, t0, t1):
        owed = _owed(pause, out, names, min_nodes, bound_s)
        if owed is not None:
            found.append(owed)
    return found


def _owed(pause: Pause, out: Mapping[str, Sequence[tuple[float, float]]], names: list[str],
          min_nodes: int, bound_s: float) -> Violation | None:
    """The first stretch of ``pause`` more than ``bound_s`` into it while enough nodes were
    settled (the set changes only at interval edges: check those and the bound). A pause
    is owed nothing before it has lasted ``bound_s`` itself, however long the nodes had
    been settled when it began (a drain's restart that starts 1 s after the nodes
    settled may take its bound like any other)."""
    first = pause.start + bound_s
    edges = sorted({first, *(e + bound_s for iv in out.values() for s, e in iv
                             if first < e + bound_s < pause.end)})
    for t in edges:
        if t >= pause.end:
            break
        here = settled_at(out, names, t, bound_s)
        if len(here) >= min_nodes:
            return Violation(round(t, 3), round(pause.end - t, 3), here)
    return None


__all__ = ["GAP_S", "RESTART_BOUND_S", "Pause", "Violation", "longest", "pauses", "settled_at",
           "violations"]
