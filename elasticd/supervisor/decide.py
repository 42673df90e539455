"""The cycle: the bookkeeping steps in their order, then the first phase rule that matches."""

from __future__ import annotations

from elasticd.actions import Action
from elasticd.supervisor import joining, journal, lifecycle, peers, reform
from elasticd.supervisor.state import Decision, Memory, Policy, Rule, Snapshot, Step

# in_place runs before progress (a re-form is not also a generic ``recovered``) and
# before worker_restarts (an exit during a re-form makes the restart a membership one);
# shrink_outcome before eviction_outcome (a failed SHRINK plans the restart's kill);
# joining before worker_restarts (it compares the workers with the last cycle's) and
# before generation_news (a record without us is not ours to take while we enter).
_BOOKKEEPING: tuple[Step, ...] = (
    lifecycle.signals, reform.in_place, joining.joining, lifecycle.progress, lifecycle.worker_restarts,
    peers.peer_news, peers.suspicions, reform.shrink_outcome, peers.eviction_outcome,
    peers.kill_due, reform.generation_news, reform.publish_world, journal.checkpoint,
    journal.journal_progress)

# Phase rules, first match wins.
_RULES: tuple[Rule, ...] = (
    lifecycle.hard_stop, lifecycle.drain, lifecycle.agent_exited, lifecycle.job_completed,
    lifecycle.reopen, lifecycle.diverged, lifecycle.unfit, peers.isolated, peers.dead_peers,
    peers.broken_round, lifecycle.hang, lifecycle.worker_crash_loop, lifecycle.start)


def decide(snap: Snapshot, mem: Memory, policy: Policy) -> Decision:
    """The next memory, the actions of this cycle and one sentence saying why."""
    if mem.phase.final:
        return Decision(mem)
    actions: list[Action] = []
    notes: list[str] = []
    for step in _BOOKKEEPING:
        mem, more, note = step(snap, mem, policy)
        actions += more
        if note:
            notes.append(note)
    for rule in _RULES:
        out = rule(snap, mem, policy)
        if out is not None:
            mem, more, note = out
            actions += more
            if note:
                notes.insert(0, note)   # the phase decision leads the sentence
            break
    return Decision(mem, tuple(actions), "; ".join(notes))
