"""The daemon's decisions: one pure function from what it saw to what it does next.

Each cycle the daemon reads a ``Snapshot`` (its agent and workers, the progress
file, the etcd view, probe news, signals), and calls
``decide(snapshot, memory, policy)``. The result is the next ``Memory`` (the
daemon's own state across cycles: phase, timers, counters), the ``Action`` list
to execute and one sentence saying why. Nothing here does I/O or reads a clock,
so every rule, timers included, is unit-tested without processes or network
(``tests/daemon/test_supervisor.py``).

The package, by concern: ``state`` (the phases and ``PHASE_EDGES``, ``Policy``, ``Snapshot``,
``Memory`` with one record per concern: ``life``, ``peer``, ``reform``, ``journal``),
``lifecycle`` (this node's agent and workers), ``peers`` (peer loss and the majority),
``reform`` (the in-place re-form as the daemon tracks it), ``journal`` (who writes the job's
record) and ``decide`` (the ordered steps and rules).

A cycle first does the bookkeeping that every phase needs (``decide._BOOKKEEPING``, in
order: signals, an in-place re-form under way, progress and the crash counter, worker
restarts and their cause, peer news (vanished records, confirmations), this node's
suspicions and the majority's verdicts (``quorum``), the shrink's and the eviction's
outcomes, kills due, generation news, the world to publish, the checkpoint hint, the
periodic journal entry), then applies the first matching phase rule (``decide._RULES``).
Phases and their edges::

    IDLE ──start──▶ RUNNING ──exit 0──▶ COMPLETED
                       │ └──exit ≠ 0──▶ BACKOFF ──delay over──▶ (start) RUNNING
                       ├──crash loop──▶ FAILED (the agent's exit or the worker restart that
                       │                 is the crash_loop_failures-th crash in the window)
                       ├──dead peer──▶ RUNNING (evict it; kill the old world's workers, or
                       │                 in-place mode: agree the next generation, the
                       │                 workers re-form; a re-form that fails or takes
                       │                 too long falls back to the kill)
                       ├──cut off from the majority──▶ (kill our agent) BACKOFF, held until
                       │                 the majority is reached again; never a failure
                       ├──our agent's round names a gone agent──▶ (kill our agent) BACKOFF,
                       │                 restarted at once; never a failure
                       ├──training hang──▶ RUNNING (kill our workers: a crash)
                       ├──loss diverged──▶ FAILED (a restart would diverge again)
                       └──this node cannot resume──▶ FAILED (it leaves; the others go on)
    IDLE, RUNNING, BACKOFF ──drain──▶ DRAINING ──agent gone──▶ STOPPED
    any non-final ──job completed elsewhere, agent gone──▶ COMPLETED
    any non-final ──second stop signal──▶ STOPPED (hard)

FAILED is entered from RUNNING only (``lifecycle``'s ``agent_exited``, ``worker_crash_loop``,
``diverged``, ``unfit``): no rule fails a node in BACKOFF. The same edges are
``PHASE_EDGES``; ``change_phase`` is the one way a rule changes the phase.
"""

from elasticd.actions import Kind
from elasticd.supervisor.decide import decide
from elasticd.supervisor.journal import records_loss, records_recovery
from elasticd.supervisor.lifecycle import drain_grace, hang_bound, restart_cause
from elasticd.supervisor.peers import gone_members
from elasticd.supervisor.state import (
    GONE_STATES,
    PHASE_EDGES,
    Death,
    Decision,
    Eviction,
    IllegalPhaseChange,
    InPlace,
    JournalMemory,
    Lifecycle,
    Memory,
    PeerMemory,
    PeerView,
    Phase,
    Policy,
    ReformMemory,
    Snapshot,
    change_phase,
)

__all__ = ["GONE_STATES", "PHASE_EDGES", "Death", "Decision", "Eviction", "IllegalPhaseChange",
           "InPlace", "JournalMemory", "Kind", "Lifecycle", "Memory", "PeerMemory", "PeerView", "Phase",
           "Policy", "ReformMemory", "Snapshot", "change_phase", "decide", "drain_grace",
           "gone_members", "hang_bound", "records_loss", "records_recovery", "restart_cause"]
