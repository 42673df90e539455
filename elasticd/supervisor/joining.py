"""A join in place as the daemon tracks it (issue 26): whether this node's next agent enters
the live world as a newcomer instead of joining a round (which would restart every
member's workers), the agreement once our workers are warm, their entry, and the
fall-back to an ordinary round.

The course: ``start`` asks ``joins_in_place`` and starts the agent with the live world's
generation (the daemon writes the enter file: ``elasticd.rendezvous.entering``); our
workers start as newcomers and report ``warm``; ``joining`` then plans GROW_IN_PLACE (the
agreement, ``inplace.agreement.grow_world``, and the record handed to our workers); the
members' daemons adopt the record by their backstop (``reform.generation_news``) and
their workers re-form after the step their world agrees; ours enter and report the new
generation. Our record says ``entering`` meanwhile (``contract.generation.Entering``):
a warm newcomer takes the other warm newcomers of the same live world into its proposal
and waits up to ``Policy.join_batch_s`` for those not warm yet, so several joiners enter
as one generation. A world that changed before our proposal (a loss, another join) is proposed
to again from its new generation; anything else that fails, or a join that outlasts its
bound, kills our agent (no failure counted) and its next start joins an ordinary round.
"""

from __future__ import annotations

from elasticd.actions import Action, Kind, act
from elasticd.contract.generation import Entering, GenerationId, GenerationRecord, base_of, current_world
from elasticd.contract.progress import WORKING
from elasticd.contract.settings import IN_PLACE
from elasticd.supervisor.reform import reform_bound_s
from elasticd.supervisor.state import GONE_STATES, Memory, Policy, Snapshot, agent_running


def joins_in_place(snap: Snapshot, mem: Memory, policy: Policy) -> GenerationId | None:
    """The live world this node's next agent enters as a newcomer, or None (an ordinary
    round). Only in the in-place mode on keyed rounds (``Policy.join_in_place``), for a
    node that is not in that world, when the live peers' records cover it (the
    agreement's base, ``generation.base_of``), it is of the job's newest round, and
    nothing holds this node back (a drain, a cut from the majority, a join that fell
    back). A world that is full (``max_nodes``) is entered all the same: our workers wait
    warm as a spare until a loss's generation takes them in or a place frees."""
    if not (policy.join_in_place and policy.recovery_mode == IN_PLACE
            and not mem.life.join_fell_back and mem.life.drain_reason is None
            and mem.peer.isolated_since is None and snap.job_state != "completed"):
        return None
    base = live_world(snap)
    if (base is None or snap.node_id in base.nodes
            or (snap.round is not None and base.id.round < snap.round)):
        return None
    return base.id


def live_world(snap: Snapshot) -> GenerationRecord | None:
    """The live in-place world as the live peers' records (or the agreed record, when it
    is newer: ``generation.base_of``) say it is; None when they do not cover one."""
    views = [p.world for p in snap.peers.values()
             if p.world is not None and p.state not in GONE_STATES]
    newest = current_world(views)
    return None if newest is None else base_of(snap.generation_record, views, newest.id)


def joining(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Bookkeeping of a join in place under way (see the module docstring)."""
    live = mem.life.joining
    if live is None:
        if mem.life.join_fell_back and snap.progress_event in WORKING:
            return mem.but(join_fell_back=False), [], ""
        return mem, [], ""
    out = snap.grown
    if out is not None:
        if out.status == "ok":   # the executor's outcome names it in this cycle's line
            return mem.but(generation_handed=out.record.id, join_agreed_at=snap.now), [], ""
        again = joins_in_place(snap, mem.but(joining=None), policy)
        if again is not None and again.same_round(live) and again != live:
            return (mem.but(joining=again, join_proposed=False), [],
                    f"the world changed to generation {again} before our join; proposing it again")
        return _fall_back(snap, mem, out.reason or "no generation with this node")
    if snap.generation is not None and snap.generation.newer_than(live):
        return _entered(snap, mem)
    if snap.round is not None and snap.round > live.round:
        # Our newcomers wait for a generation of a round the job has left (a restart).
        return _fall_back(snap, mem, f"the job moved on to round {snap.round}")
    if mem.life.workers and snap.workers != mem.life.workers:
        # Our newcomers exited (their entry failed): the agent's next round is ordinary.
        return _given_up(snap, mem, "our newcomers exited before they entered", [])
    if snap.progress_event == "warm" and not mem.life.join_proposed and agent_running(snap):
        return _propose(snap, mem, policy, live)
    return _timed_out(snap, mem, policy)


def entering(snap: Snapshot, live: GenerationId | None, policy: Policy, warm: bool) -> list[Action]:
    """Publish that our newcomers wait to enter ``live`` (warm yet or not); nothing when
    this start joins an ordinary round."""
    if live is None:
        return []
    return [act(Kind.PUBLISH, fields={
        "entering": Entering(snap.node_id, live, warm, policy.nproc).to_record()})]


def _propose(snap: Snapshot, mem: Memory, policy: Policy,
             live: GenerationId) -> tuple[Memory, list[Action], str]:
    """Our workers are warm: agree the generation with us and every other warm newcomer
    of ``live``, after waiting (``join_batch_s`` at most) for those not warm yet; in a
    world that is full, wait as a spare."""
    actions: list[Action] = []
    if mem.life.join_warm_at is None:   # just warm: say so, for the other newcomers
        mem = mem.but(join_warm_at=snap.now)
        actions = entering(snap, live, policy, warm=True)
    warm_for = snap.now - (mem.life.join_warm_at or snap.now)
    record = snap.generation_record
    named = record is not None and record.id.same_round(live) and snap.node_id in record.joined
    base = live_world(snap)
    if base is None and not named:
        return mem, actions, ""   # the records cover no world this cycle (a re-form under way)
    room = policy.max_nodes - len(base.nodes) - 1 if base is not None else 0
    if room < 0 and not named:
        said = (f"our workers are warm; the world is full ({policy.max_nodes} nodes): they "
                "wait as a spare for a lost node's place") if actions else ""
        return mem, actions, said
    cold = [e.node for e in snap.newcomers(live, warm=False)]
    if cold and not named and warm_for < policy.join_batch_s:
        said = (f"our workers are warm; waiting up to {policy.join_batch_s:.0f} s for the newcomers "
                f"of {', '.join(cold)} to be warm too (one generation for all)") if actions else ""
        return mem, actions, said
    if base is not None and base.id != live and base.id.same_round(live) and not named:
        live = base.id   # the world changed while we waited: propose to it
        mem = mem.but(joining=live)
    others = tuple((e.node, e.nproc) for e in snap.newcomers(live))[:max(room, 0)]
    with_them = f" and {', '.join(n for n, _ in others)}" if others else ""
    said = (f"our workers are warm; generation {record.id} names this node already: adopting it"
            if named and record is not None else
            f"our workers are warm; agreeing the next generation with this node{with_them}")
    return mem.but(join_proposed=True), [*actions, act(Kind.GROW_IN_PLACE, live=live, others=others)], said


def _timed_out(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    if mem.life.join_warm_at is not None and mem.life.join_agreed_at is None:
        return mem, [], ""   # warm: a spare (or a batch's wait, bounded itself) waits
    if mem.life.join_agreed_at is not None:
        # The members take it after the step their world agrees (their step time is not
        # known here: the bound of a planned change, twice).
        waited, bound = snap.now - mem.life.join_agreed_at, 2 * reform_bound_s(policy, mem, True)
        what = "entered the agreed generation"
    else:
        waited, bound = snap.now - (mem.life.joining_since or snap.now), policy.join_warm_timeout_s
        what = "were warm and admitted"
    if waited < bound:
        return mem, [], ""
    return _fall_back(snap, mem, f"our workers had not {what} {waited:.1f} s on (bound {bound:.0f} s)")


def _entered(snap: Snapshot, mem: Memory) -> tuple[Memory, list[Action], str]:
    """Our workers report the generation with us: one ``joined-in-place`` event
    (``node-joined`` is the daemon's registration in etcd)."""
    took = round(snap.now - (mem.life.joining_since or snap.now), 3)
    record = snap.generation_record
    replaced = list(record.lost) if record is not None and record.id == snap.generation else []
    mem = mem.but(joining=None, joining_since=None, join_proposed=False, join_agreed_at=None,
                  join_warm_at=None)
    actions = [act(Kind.PUBLISH, fields={"entering": None}),
               act(Kind.OBSERVE, metric="join_seconds", label="spare" if replaced else "in-place",
                   value=took),
               act(Kind.COUNT, metric="in_place_recoveries", label="ok"),
               act(Kind.JOURNAL, event="joined-in-place", fields={
                   "in_place": True, "join_s": took, "generation": str(snap.generation),
                   "replaced": replaced,
                   "world_size": snap.world.world_size if snap.world is not None else None})]
    how = f" as a spare in place of {', '.join(replaced)}" if replaced else " in place"
    return mem, actions, (f"our workers entered generation {snap.generation}{how}, {took:.1f} s "
                          "after our agent started; nobody restarted")


def _fall_back(snap: Snapshot, mem: Memory, reason: str) -> tuple[Memory, list[Action], str]:
    """Kill our agent (its exit is no failure: ``agent_released``); it starts again at once
    and joins an ordinary round (the members restart for it: today's path)."""
    kill = [act(Kind.KILL_AGENT)] if agent_running(snap) else []
    return _given_up(snap, mem.but(agent_released=bool(kill)), reason, kill)


def _given_up(snap: Snapshot, mem: Memory, reason: str,
              actions: list[Action]) -> tuple[Memory, list[Action], str]:
    """No join in place this time: the restart that follows is a membership change, not
    this node's crash, and the next start joins an ordinary round."""
    took = round(snap.now - (mem.life.joining_since or snap.now), 3)
    mem = mem.but(joining=None, joining_since=None, join_proposed=False, join_agreed_at=None,
                  join_warm_at=None, join_fell_back=True, membership_changed_at=snap.now)
    actions = [*actions, act(Kind.PUBLISH, fields={"entering": None}),
               act(Kind.JOURNAL, event="in-place-fallback",
                   fields={"reason": reason, "fault": "join", "duration_s": took}),
               act(Kind.COUNT, metric="in_place_recoveries", label="fallback")]
    return mem, actions, f"the join in place fell back to an ordinary round ({reason})"


__all__ = ["entering", "joining", "joins_in_place", "live_world"]
