"""Peer loss: vanished records and their confirmation, this node's suspicions and the
majority's verdicts (``quorum``), evictions and their outcome, the kill of workers left in
the old world, a round that names a gone agent, and being cut off from the majority."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from elasticd import quorum
from elasticd.actions import Action, Kind, act
from elasticd.contract.settings import IN_PLACE
from elasticd.inplace import loss
from elasticd.supervisor.journal import records_loss
from elasticd.supervisor.reform import plan_shrink
from elasticd.supervisor.state import (
    GONE_STATES,
    Death,
    Memory,
    PeerView,
    Phase,
    Policy,
    Snapshot,
    agent_running,
    begin_recovery,
)

# A refused probe this recent classifies a vanished peer as crashed without a confirmation.
REFUSED_FRESH_S = 2.0


def peer_news(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """Vanished records (etcd decided: the peer's lease expired), confirmations, new peers."""
    actions: list[Action] = []
    notes: list[str] = []
    refused_at = {n: t for n, t in mem.peer.refused_at.items() if snap.now - t < REFUSED_FRESH_S}
    refused_at.update({p.node_id: snap.now for p in snap.refused})
    suspects = dict(mem.peer.suspects)
    dead = dict(mem.peer.dead)
    for peer in snap.departed:
        if peer.node_id in mem.peer.condemned:
            continue   # the majority's verdict was acted on already
        # A refusal moments ago needs no second probe.
        how = loss.departed(peer.state in GONE_STATES,
                            loss.REFUSED if peer.node_id in refused_at else None)
        if how is None:
            suspects[peer.node_id] = (peer, snap.now)
            actions.append(act(Kind.CONFIRM_PEER, peer=peer))
        else:
            dead[peer.node_id] = Death(peer, how)
    for node_id, (peer, since) in list(suspects.items()):
        answer = snap.confirmations.get(node_id)
        if answer is None and snap.now - since < policy.confirm_timeout_s:
            continue
        del suspects[node_id]
        how = loss.departed(False, answer or loss.SILENT)   # no answer in time: silent
        if how == loss.ALIVE:
            notes.append(f"peer {node_id}'s record vanished but it answers; waiting for it to "
                         "re-register")
        else:
            dead[node_id] = Death(peer, how)
    seen = frozenset(snap.peers)
    changed = snap.departed or (seen - mem.peer.peers_seen)
    mem = mem.but(suspects=suspects, dead=dead, peers_seen=seen, refused_at=refused_at,
                  membership_changed_at=snap.now if changed else mem.peer.membership_changed_at)
    return mem, actions, "; ".join(notes)


def suspicions(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """This node's suspicions from its probes, published; the majority's verdicts
    (``quorum.condemned``) become deaths once each; whether this node is cut off."""
    mine, silent = _own_suspicions(snap, mem, policy)
    notes = [_suspicion_note(n, mine[n][0]) for n in sorted(set(mine) - set(mem.peer.suspicions))]
    actions: list[Action] = []
    if frozenset(mine) != mem.peer.published_suspects:
        actions.append(act(Kind.PUBLISH, fields={"suspects": sorted(mine)}))
    me, votes = snap.node_id, set(mine)
    condemned = quorum.condemned(me, votes, snap.peers)
    held = _held_verdicts(mem.peer.condemned, condemned, snap.peers)
    dead = dict(mem.peer.dead)
    for node in sorted(condemned - set(held)):
        held[node] = snap.peers[node].agent
        if node not in mem.peer.evicting:
            dead[node] = Death(snap.peers[node], mine.get(node, ("silent", 0.0))[0])
            notes.append(f"a majority of the members suspect peer {node}")
    isolated = quorum.isolated(me, votes, snap.peers)
    if isolated and mem.peer.isolated_since is None:
        notes.append(f"this node reaches {len(snap.peers) + 1 - len(votes & set(snap.peers))} of "
                     f"the {len(snap.peers) + 1} live members: cut off from the majority")
    elif not isolated and mem.peer.isolated_since is not None:
        notes.append("this node reaches the majority again")
    mem = mem.but(suspicions=mine, silent_since=silent, published_suspects=frozenset(mine),
                  dead=dead, condemned=held,
                  isolated_since=(mem.peer.isolated_since or snap.now) if isolated else None)
    return mem, actions, "; ".join(notes)


def _held_verdicts(verdicts: Mapping[str, tuple[str, int] | None], condemned: frozenset[str],
                   peers: Mapping[str, PeerView]) -> dict[str, tuple[str, int] | None]:
    """The earlier verdicts still in force: a verdict is on one incarnation of a node, so
    it holds while the node has a record and either the majority still suspects it or
    the record still names the agent it was passed on. A node restarted before its
    old lease ran out (its new daemon overwrote the record) is a new member once it
    answers; before, its verdict lived as long as the key, and every round the node
    joined was taken as naming a gone agent (the demo's rejoin in CI: the survivors
    released their agents every few seconds, no world of 3 in 120 s)."""
    return {n: agent for n, agent in verdicts.items()
            if n in peers and (n in condemned or peers[n].agent == agent)}


def _own_suspicions(snap: Snapshot, mem: Memory, policy: Policy
                    ) -> tuple[dict[str, tuple[str, float]], dict[str, float]]:
    """``loss.suspicions`` over this cycle's probes (a refusal seen by the prober counts too)."""
    answers = {**snap.probe_answers, **{p.node_id: loss.REFUSED for p in snap.refused}}
    return loss.suspicions(answers, snap.peers, mem.peer.suspicions, mem.peer.silent_since, snap.now,
                           policy.silent_suspect_s)


def _suspicion_note(node: str, how: str) -> str:
    return (f"peer {node} refused its liveness probe" if how == "crashed"
            else f"peer {node} has not answered its probes")


def eviction_outcome(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """After an EVICT: plan the kill of the old world's workers; retry a failed eviction."""
    if snap.eviction is None or not mem.peer.evicting:
        return mem, [], ""
    deaths = [mem.peer.evicting[n] for n in snap.eviction.peers if n in mem.peer.evicting]
    evicting = {n: d for n, d in mem.peer.evicting.items() if n not in snap.eviction.peers}
    mem = mem.but(evicting=evicting, membership_changed_at=snap.now)
    first = [d for d in deaths if d.attempts == 1]
    if not snap.eviction.ok:
        # etcd did not answer: retry in a second. Our workers must not stay in a broken
        # world meanwhile, so the kill is planned now all the same.
        mem = mem.but(dead={**mem.peer.dead, **{d.peer.node_id: d for d in deaths}},
                      evict_at=snap.now + 1.0)
    if snap.eviction.ok and snap.eviction.in_round is not None:
        in_round = snap.eviction.in_round and bool(first)
    else:
        # A peer whose agent was running was surely in our round.
        in_round = any(d.peer.state == "running" and d.peer.agent for d in first)
    if not in_round or not snap.workers or mem.phase is not Phase.RUNNING or _newcomers(mem):
        return mem, [], ""
    ip = mem.reform.in_place
    handled = set(ip.lost if ip is not None else ()) | mem.reform.reformed_without
    if {d.peer.node_id for d in first} <= handled:
        return mem, [], ""   # the workers re-form in place; the timers below fall back
    if any(d.how == "silent" for d in first):
        return mem, [act(Kind.KILL_WORKERS, pids=snap.workers)], \
            "a silent peer leaves our workers hung in a collective; killing them now"
    if mem.peer.kill_at is None:
        mem = mem.but(kill_at=snap.now + policy.kill_grace_s, kill_pids=snap.workers)
    return mem, [], ""


def kill_due(snap: Snapshot, mem: Memory, policy: Policy) -> tuple[Memory, list[Action], str]:
    """The grace after a crashed peer is over: kill workers still in the old world."""
    if mem.peer.kill_at is None or snap.now < mem.peer.kill_at:
        return mem, [], ""
    stuck = mem.peer.kill_pids & snap.workers
    mem = mem.but(kill_at=None, kill_pids=frozenset())
    if not stuck:
        return mem, [], ""
    return mem, [act(Kind.KILL_WORKERS, pids=stuck)], \
        f"killing {len(stuck)} worker(s) still in the old world after the {policy.kill_grace_s:.0f} s grace"


def isolated(snap: Snapshot, mem: Memory, policy: Policy):
    """Cut off from the majority: stop our workers (the majority goes on without this
    node, and must not find it in its next round) and start nothing until it is back."""
    if mem.peer.isolated_since is None or mem.phase not in (Phase.RUNNING, Phase.BACKOFF):
        return None
    if agent_running(snap):
        return mem, [act(Kind.KILL_AGENT)], \
            "stopping this node's workers until it reaches the majority of the members again"
    return mem, [], ""


def dead_peers(snap: Snapshot, mem: Memory, policy: Policy):
    if not mem.peer.dead or snap.now < mem.peer.evict_at:
        return None
    names = ", ".join(sorted(mem.peer.dead))
    tried = {n: replace(d, attempts=d.attempts + 1) for n, d in mem.peer.dead.items()}
    new = sorted(n for n, d in mem.peer.dead.items() if d.attempts == 0)
    # A peer our workers already re-formed without (it drained in place, or left during a
    # re-form) costs them nothing when its record goes: its agent is still evicted, but
    # that is no fault, no recovery to time and no second re-form.
    first = [n for n in new if n not in mem.reform.reformed_without]
    mem = mem.but(evicting={**mem.peer.evicting, **tried}, dead={}, membership_changed_at=snap.now)
    if first:
        mem = begin_recovery(mem, f"peer-{tried[first[0]].how}", snap.now)
    actions = [act(Kind.EVICT, peers=tuple(d.peer for d in tried.values()))]
    if records_loss(snap, mem, tried):
        actions += [act(Kind.JOURNAL, event="peer-lost", fields={"peer": n, "how": tried[n].how})
                    for n in first]
    actions += [act(Kind.COUNT, metric="evictions", label=tried[n].how) for n in new]
    if new and not first:
        return mem, actions, (f"peer(s) {names} gone, which our workers already re-formed "
                              "without; evicting them from the rendezvous")
    if not first:
        return mem, actions, f"retrying the eviction of peer(s) {names}"
    ours = mem.phase is Phase.RUNNING and not _newcomers(mem)
    tail = " and restarting the local workers" if ours else ""
    if policy.recovery_mode == IN_PLACE and ours and snap.workers:
        mem, more, tail = plan_shrink(snap, mem, [tried[n] for n in first])
        actions += more
    return mem, actions, f"peer(s) {names} lost; evicting them from the rendezvous{tail}"


def _newcomers(mem: Memory) -> bool:
    """Our workers are newcomers (a join in place, a spare) and in no world yet: a peer's
    loss is the members' to re-form (a spare is taken in by their record), never a reason
    to restart or kill ours. Seen: a spare's daemon, a voter on a rank-0 node's crash,
    planned the old world's kill for its warm workers and killed them 2 s after they had
    entered the loss's generation in the lost node's place."""
    return mem.life.joining is not None


def _trained_in_round(snap: Snapshot, mem: Memory) -> bool:
    """Whether our workers have stepped in the rendezvous' newest round (a loss there is
    the in-place re-form's or the kill's, not a round still forming). Workers that have
    reported nothing at all (a joiner's first round, before its first step) trained in no
    round: goodput seed 11 stalled 40 s for good when a joiner's agent sat in a round whose
    other new member was killed, taken as "a script that reports no generation"."""
    if snap.generation is None:
        # Progress without a generation: a script that reports none; its rounds are not
        # ours to judge. No progress yet: these workers never stepped anywhere.
        return snap.step is not None
    return snap.round is None or snap.generation.round >= snap.round


def gone_members(snap: Snapshot, mem: Memory) -> frozenset[tuple[str, int]]:
    """The agents of the newest round that no live member's record names: their node is
    gone (its record expired or left), has a new agent, or the majority condemned the
    agent (a condemned node's new agent is live: the verdict was on the old one)."""
    live = {p.agent for n, p in snap.peers.items() if p.agent and p.state not in GONE_STATES
            and (n not in mem.peer.condemned or mem.peer.condemned[n] != p.agent)}
    mine = (snap.agent_addr, snap.agent_pid)
    return frozenset(a for a in snap.round_members if a != mine and a not in live)


def broken_round(snap: Snapshot, mem: Memory, policy: Policy):
    """Our agent forms a round (rank assignment, its workers' group init and resume) with
    a member that is gone: torchrun waits for it until the store's timeout (issue 29: a
    node frozen between a round's close and its rank assignment stalled the job for
    good; a joiner that left did the same). Kill our agent once the grace is over (not at
    once for a member known gone, tried in 704bf82: the scale harness's survivors then lost
    agents that were already forming the next round): it starts again at once, no failure
    counted, and joins the next round without it."""
    if (not policy.release_broken_rounds or mem.phase is not Phase.RUNNING
            or not agent_running(snap) or _trained_in_round(snap, mem)):
        return None
    mine = (snap.agent_addr, snap.agent_pid)
    gone = gone_members(snap, mem) if mine in snap.round_members else frozenset()
    if not gone:  # (a round without our agent is not one it waits in)
        return None if mem.life.round_broken_since is None else (
            mem.but(round_broken_since=None), [], "")
    since = mem.life.round_broken_since if mem.life.round_broken_since is not None else snap.now
    if snap.now - since < policy.broken_round_grace_s:
        return mem.but(round_broken_since=since), [], ""
    names = ", ".join(f"{addr}:{pid}" for addr, pid in sorted(gone))
    mem = mem.but(round_broken_since=None, agent_released=True,
                  membership_changed_at=snap.now)
    return (mem, [act(Kind.KILL_AGENT), act(Kind.LEAVE_RENDEZVOUS),
                  act(Kind.COUNT, metric="worker_restarts", label="membership")],
            f"round {snap.round} names agent(s) {names} that are gone; restarting our agent so "
            "that the next round forms without them")
