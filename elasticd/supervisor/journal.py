"""Who writes the job's record: which node journals a loss or a recovery (one entry per
fault, not one per node), the committed checkpoint and the periodic progress point."""

from __future__ import annotations

from collections.abc import Collection

from elasticd.actions import Action, Kind, act
from elasticd.contract.generation import WorldView
from elasticd.supervisor.state import GONE_STATES, Memory, Phase, Policy, Snapshot

# Faults of this node alone (its own workers, agent or hang): only this node can tell them.
LOCAL_FAULTS = frozenset({"worker-crash", "agent-crash", "hang"})


def records_loss(snap: Snapshot, mem: Memory, lost: Collection[str]) -> bool:
    """Whether this node journals the loss of ``lost``: every survivor decides the same loss,
    and one entry per fault (not one per node: 2,047 writes at 2,048 nodes) is written by
    the survivor whose workers hold the lowest rank, as the nodes' records publish their
    worlds (by node id where a world is unknown). Every survivor reads the same records,
    so they name the same writer; a survivor that sees a peer the others already lost may
    write a second entry. None is written only when the lower-ranked peer they defer to
    dies before the loss is journaled (its own loss is then journaled by the next one)."""
    gone = set(lost) | set(mem.peer.dead) | set(mem.peer.evicting) | set(mem.peer.refused_at)

    def key(node: str, world: WorldView | None) -> tuple[float, str]:
        return (world.first_rank if world is not None else float("inf"), node)

    mine = key(snap.node_id, snap.world)
    return all(mine <= key(n, p.world) for n, p in snap.peers.items()
               if n not in gone and n != snap.node_id and p.state not in GONE_STATES)


def records_recovery(snap: Snapshot, kind: str) -> bool:
    """Whether this node journals a recovery from ``kind``: a fault of this node alone by
    this node; a shared one (a lost peer: every survivor recovers) once, by the node whose
    workers hold rank 0 of the new world (its progress file says so)."""
    return kind in LOCAL_FAULTS or snap.rank0_here


def checkpoint(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Publish a newly committed checkpoint; the rank-0 node also journals it (once per job)."""
    step = snap.checkpoint_step
    if step is None or step == mem.journal.published_checkpoint:
        return mem, [], ""
    actions = [act(Kind.PUBLISH_CHECKPOINT, step=step)]
    if snap.rank0_here:
        actions.append(act(Kind.JOURNAL, event="checkpoint-committed", fields={"checkpoint": step}))
    return mem.but(published_checkpoint=step), actions, ""


def journal_progress(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """The rank-0 node journals where training stands every ``progress_every_s``: the
    points of a job's timeline between events (one writer per job, not one per node)."""
    if (not snap.rank0_here or snap.step is None or mem.phase is not Phase.RUNNING
            or snap.now - mem.journal.journaled_at < policy.progress_every_s):
        return mem, [], ""
    return mem.but(journaled_at=snap.now), [act(Kind.JOURNAL, event="progress", fields={})], ""
