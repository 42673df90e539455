"""The in-place re-form as the daemon tracks it: the SHRINK it plans after a loss, its
outcome, the agreed generation handed to our workers (or fencing this node out), the
workers' report, and the fall-back to a restart when the re-form fails or outlasts its
bound. The rules both paths share are ``elasticd.inplace``'s."""

from __future__ import annotations

import statistics
from dataclasses import replace

from elasticd.actions import Action, Kind, act
from elasticd.contract.generation import GenerationId, GenerationRecord
from elasticd.contract.settings import IN_PLACE
from elasticd.inplace import loss
from elasticd.supervisor.journal import records_recovery
from elasticd.supervisor.state import Death, InPlace, Memory, Phase, Policy, Snapshot

# After a SHRINK the workers get their own bound plus this (their report's way to us)
# before the daemon kills them (the restart path).
IN_PLACE_SLACK_S = 2.0


def reform_bound_s(policy: Policy, mem: Memory, planned: bool) -> float:
    """How long an in-place change may take before the daemon gives up on it: the
    workers' bound plus the slack; a planned one (a drain) is taken after the next step
    the world agrees, so it also gets two median steps (0 before any step is timed)."""
    steps = statistics.median(mem.life.intervals) if planned and mem.life.intervals else 0.0
    return policy.recovery_bound_s + IN_PLACE_SLACK_S + 2 * steps


def _in_place_fallback(snap: Snapshot, mem: Memory, reason: str,
                       duration_s: float | None = None) -> tuple[Memory, list[Action], str]:
    """Give up the in-place re-form: the workers' restart that follows is a membership one."""
    ip = mem.reform.in_place
    took = round(duration_s if duration_s is not None else snap.now - ip.since, 3)
    mem = mem.but(in_place=None, membership_changed_at=snap.now)
    return mem, [act(Kind.JOURNAL, event="in-place-fallback",
                     fields={"reason": reason, "duration_s": took, "lost": list(ip.lost)}),
                 act(Kind.COUNT, metric="in_place_recoveries", label="fallback")], \
        f"the in-place re-form fell back to a worker restart ({reason})"


def _in_place_done(snap: Snapshot, mem: Memory) -> tuple[Memory, list[Action], str]:
    """The workers report the new generation: one ``recovered-in-place`` event (the
    generic ``recovered`` is cleared with ``recovering``)."""
    ip = mem.reform.in_place
    took = round(snap.now - ip.since, 3)
    reform = snap.reform if snap.reform is not None and snap.reform.event == "reformed" else None
    worker_s = reform.duration_s if reform is not None else None
    fields = {"duration_s": worker_s if worker_s is not None else took, "daemon_s": took,
              "from_world_size": reform.from_world_size if reform is not None else None,
              "world_size": snap.world.world_size if snap.world is not None else None,
              "generation": str(snap.generation), "fault": ip.fault, "lost": list(ip.lost)}
    mem = mem.but(in_place=None, recovering=None,
                  reformed_without=mem.reform.reformed_without | frozenset(ip.lost))
    label = f"{ip.fault}-in-place" if ip.planned else "in-place"
    actions = [act(Kind.OBSERVE, metric="recovery_seconds", label=label, value=took),
               act(Kind.COUNT, metric="in_place_recoveries", label="ok")]
    if records_recovery(snap, ip.fault):
        actions.insert(0, act(Kind.JOURNAL, event="recovered-in-place", fields=fields))
    return mem, actions, \
        f"the workers re-formed in place as generation {snap.generation} {took:.1f} s after a {ip.fault}"


def in_place(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Watch an in-place re-form: success, the workers' own failure, their exit, or the
    timeout (bound + slack) after which the daemon kills them for torchrun."""
    ip = mem.reform.in_place
    if ip is None:
        return mem, [], ""
    if snap.reform is not None and snap.reform.event == "reform-failed":
        return _in_place_fallback(snap, mem, snap.reform.reason or "reform-failed",
                                  snap.reform.duration_s)
    if snap.generation is not None and snap.generation.newer_than(ip.base):
        # Also when the ``reformed`` record was overwritten by a step before we read it.
        return _in_place_done(snap, mem)
    if ip.agreed and snap.workers != mem.life.workers:
        return _in_place_fallback(snap, mem, "workers-exited")
    waited = snap.now - ip.since
    if waited < reform_bound_s(policy, mem, ip.planned):
        return mem, [], ""
    mem, actions, note = _in_place_fallback(snap, mem, "timeout")
    if snap.workers:
        actions.insert(0, act(Kind.KILL_WORKERS, pids=snap.workers))
    return mem, actions, f"{note}: no re-form report {waited:.1f} s after the loss; killing the workers"


def shrink_outcome(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """After a SHRINK: the record is agreed (wait for the workers), or the restart path."""
    out = snap.shrink
    if out is not None and out.status == "ok":
        # The executor wrote the file: handed, even if the workers already gave up on it
        # in this same cycle (else the backstop would hand it to their successors).
        mem = mem.but(generation_handed=out.record.id)
    if out is None or mem.reform.in_place is None:
        return mem, [], ""
    if out.status == "ok":
        mem = mem.but(in_place=replace(mem.reform.in_place, agreed=True))
        verb = "agreed" if out.wrote else "adopted"
        return mem, [], (f"generation {out.record.id} {verb} without {', '.join(out.lost)}; "
                         f"the workers re-form in place ({out.record.world_size} workers)")
    if out.status == "unneeded":
        return mem.but(in_place=None), [], ""
    if out.status == "fenced":
        return _fenced_out(snap, mem, out.record)
    # failed: eviction_outcome (same snapshot) plans the kill as the restart mode does.
    return _in_place_fallback(snap, mem, out.reason or "no in-place generation")


def _fenced_out(snap: Snapshot, mem: Memory, record: GenerationRecord) -> tuple[Memory, list[Action], str]:
    """The agreed generation leaves this node out: our workers leave and rejoin as a new round."""
    mem = mem.but(generation_handed=record.id)
    mem, actions, _ = _in_place_fallback(snap, mem, "fenced-out")
    if snap.workers:
        actions.insert(0, act(Kind.KILL_WORKERS, pids=snap.workers))
    return mem, actions, (f"generation {record.id} was agreed without this node; killing our "
                          "workers so that they rejoin as a new round")


def _handed(mem: Memory, gid: GenerationId) -> bool:
    h = mem.reform.generation_handed
    return h is not None and h.same_round(gid) and h.seq >= gid.seq


def generation_news(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """The backstop: an agreed record newer than our workers' generation, of their round,
    not yet handed to them (another daemon agreed it first, or our SHRINK failed)."""
    rec, gen = snap.generation_record, snap.generation
    if (rec is None or gen is None or policy.recovery_mode != IN_PLACE or not snap.workers
            or mem.phase is not Phase.RUNNING or not rec.id.newer_than(gen) or _handed(mem, rec.id)):
        return mem, [], ""
    if mem.life.joining is not None and rec.member(snap.node_id) is None:
        return mem, [], ""   # our newcomers are in no world yet: nothing to fence them out of
    if mem.reform.in_place is None:
        mem = mem.but(in_place=InPlace(rec.lost, snap.now, gen, rec.cause or "peer-lost",
                                       planned=rec.planned),
                      membership_changed_at=snap.now)
    if rec.member(snap.node_id) is None:
        return _fenced_out(snap, mem, rec)
    mem = mem.but(generation_handed=rec.id, in_place=replace(mem.reform.in_place, agreed=True))
    when = " (they take it after the step the world agrees)" if rec.planned else ""
    change = (f"with {', '.join(rec.joined)}" if rec.joined
              else f"without {', '.join(rec.lost) or '-'}")
    return mem, [act(Kind.WRITE_GENERATION, record=rec)], (
        f"generation {rec.id} was agreed {change}; handing it to our workers{when}")


def publish_world(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Our record says what our workers report of their world (the others' base for a shrink)."""
    if snap.world is None or snap.world == mem.reform.published_world:
        return mem, [], ""
    return mem.but(published_world=snap.world), \
        [act(Kind.PUBLISH, fields={"world": snap.world.to_record()})], ""


def left_out_while_draining(snap: Snapshot, mem: Memory):
    """The others agreed a generation without this draining node (a peer was lost during
    the drain: see ``plan_shrink``): our workers' coordinated stop cannot finish in the
    old world, and the others go on in place without us; kill them now instead of at the
    drain grace's end (nothing of theirs is needed: the others hold the live state)."""
    rec, gen = snap.generation_record, snap.generation
    if (not snap.workers or rec is None or gen is None or not rec.id.newer_than(gen)
            or rec.member(snap.node_id) is not None or _handed(mem, rec.id)):
        return None
    return (mem.but(generation_handed=rec.id), [act(Kind.KILL_WORKERS, pids=snap.workers)],
            f"generation {rec.id} was agreed without this draining node; killing our workers "
            "(the others go on in place)")


def plan_shrink(snap: Snapshot, mem: Memory, deaths: list[Death]) -> tuple[Memory, list[Action], str]:
    """In-place mode: agree the next generation instead of killing our workers (a loss
    during a re-form widens it: the lost nodes accumulate, the start time stays)."""
    if snap.generation is None:
        # Workers that report no generation (plain torchrun scripts) cannot re-form.
        lost = tuple(sorted(d.peer.node_id for d in deaths))
        mem = mem.but(in_place=InPlace(lost, snap.now, GenerationId(0), ""))
        mem, actions, _ = _in_place_fallback(snap, mem, "the workers report no generation")
        return mem, actions, " and restarting the local workers (they report no generation)"
    if mem.life.step_at is None and mem.reform.in_place is None:
        # Our workers have not stepped since they were (re)started: the generation their
        # progress names is the previous group's, which no longer exists to re-form (seen by
        # the chaos suite: a drain's coordinated stop restarted them in the cycle the leaver
        # was found gone, and the re-form's timer then killed the new group mid-start: 6
        # steps lost). The restart under way forms its round without the lost peer.
        return mem, [], " and restarting the local workers (they have not stepped since they started)"
    fault = loss.loss_cause(d.how for d in deaths)
    ip = mem.reform.in_place or InPlace((), snap.now, snap.generation, fault)
    # A peer that drains is left out too: its coordinated stop needs the whole old world
    # (a lost member holds it until its drain grace, 30 s), and it re-forms with no one
    # (seen in the goodput benchmark, seed 7: a freeze, a drain 2.3 s later, the re-form
    # waited for the drainer, fell back to a restart that waited 30 s for its agent).
    ip = replace(ip, lost=tuple(sorted({*ip.lost, *(d.peer.node_id for d in deaths),
                                        *leaving_peers(snap)})), agreed=False)
    # Warm spares (newcomers of a full world) take the lost nodes' places in this re-form.
    spares = tuple((e.node, e.nproc) for e in snap.newcomers(ip.base))[:len(ip.lost)]
    with_spares = f" with the spare(s) {', '.join(n for n, _ in spares)}" if spares else ""
    return mem.but(in_place=ip), \
        [act(Kind.SHRINK, lost=ip.lost, cause=ip.fault, peers=tuple(d.peer for d in deaths),
             generation=ip.base, spares=spares)], f" and re-forming the world in place{with_spares}"


def leaving_peers(snap: Snapshot) -> tuple[str, ...]:
    """The peers whose record says they drain (their daemon published ``leaving``)."""
    return tuple(sorted(n for n, p in snap.peers.items() if p.state == "leaving"))
