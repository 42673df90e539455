"""Fenced edits of the live rendezvous state by the daemon (not by torch).

Both layouts are served: torch's one pickled state (``rounds=torch``) and keyed rounds
(``rounds=keyed``, ``keyed.py``); a job uses the keyed one when its ``rdzv/round``
pointer exists. On keyed rounds an eviction is the revocation of the dead agent's
liveness lease (its liveness and join keys go with it, in one step), a reopen deletes
the ``closed`` key, and the round is the pointer's.

Every edit is read-modify-write with a compare on the key's mod_revision, so it never
overwrites an agent's concurrent update: on a lost race it re-reads and re-applies the
(idempotent) pure operation. Each call has a wall-clock budget: the daemon's loop calls
these from its 100 ms tick, so every etcd call inside fails fast (``no_retry``: an
outage raises ``EtcdError`` at once) and lost races are retried only while the budget
lasts. A stopped (not dead) etcd still costs up to the client's read timeout per call:
the budget is checked between calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace

import structlog

from elasticd.etcd_client import EtcdClient, KeyValue, deadline, no_retry
from elasticd.rendezvous import state_ops
from elasticd.rendezvous.joins import count_joins
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.rounds import Agent, World, decode_pointer
from elasticd.rendezvous.state_ops import Removal, RoundView

log = structlog.get_logger(__name__)


def _fenced_edit(client: EtcdClient, keys: JobKeys, deadline_s: float,
                 edit: Callable[[bytes], bytes | None]) -> tuple[bool, bool]:
    """Apply ``edit`` to the state until a fenced write wins or ``deadline_s`` passes.

    Returns ``(changed, gave_up)``: ``changed`` if this call wrote a new state;
    ``gave_up`` if it lost races until the budget ran out. ``edit`` returning None
    means "nothing to change".
    """
    end = time.monotonic() + deadline_s
    with no_retry():
        while True:
            kv: KeyValue | None = client.get(keys.rdzv_state)
            if kv is None:
                return False, False
            new = edit(kv.value)
            if new is None:
                return False, False
            won, _ = client.put_or_create(keys.rdzv_state, new, kv.mod_revision,
                                          lease=kv.lease_id or None)
            if won:
                return True, False
            if time.monotonic() >= end:
                return False, True


def evict_agents(client: EtcdClient, keys: JobKeys, agents: set[tuple[str, int]],
                 min_nodes: int, deadline_s: float = 2.0) -> Removal:
    """Remove these agents from the rendezvous at once (instead of after torch's keep-alive).

    ``deadline_s`` bounds the whole call (wall clock). Raises ``EtcdError`` if etcd is
    unavailable, ``CorruptStateError`` (an ``EtcdError``) if the state is not torch's.
    """
    keyed = _evict_keyed(client, keys, agents, deadline_s)
    if keyed is not None:
        return keyed
    result: list[Removal] = []

    def edit(value: bytes) -> bytes | None:
        removal = state_ops.remove_agents(value, agents, min_nodes, keys.rdzv_state)
        result[:] = [removal]
        return removal.state

    changed, gave_up = _fenced_edit(client, keys, deadline_s, edit)
    if gave_up:
        log.warning("gave up evicting agents after repeated races", agents=sorted(agents),
                    budget_s=deadline_s)
    return result[0] if changed else Removal(None, (), False)


def reopen_if_closed(client: EtcdClient, keys: JobKeys, deadline_s: float = 2.0) -> bool:
    """Reopen a rendezvous state that an agent closed; True if this call reopened it.

    For the daemon to call while the job is not completed: torch closes the state
    when any agent gives up, which would make every agent fail from then on.
    ``deadline_s`` bounds the whole call; ``EtcdError`` as for ``evict_agents``.
    """
    with no_retry(), deadline(deadline_s):
        if client.delete(keys.rdzv_closed):
            log.warning("reopened the rendezvous an agent had closed", key=keys.rdzv_closed)
            return True
    changed, gave_up = _fenced_edit(client, keys, deadline_s,
                                    lambda value: state_ops.reopen(value, keys.rdzv_state))
    if changed:
        log.warning("reopened the rendezvous an agent had closed", key=keys.rdzv_state)
    elif gave_up:
        log.warning("gave up reopening the rendezvous after repeated races", budget_s=deadline_s)
    return changed


# torch's exit barrier (torch/distributed/elastic/agent/server/api.py ``_exit_barrier`` and
# utils/store.py ``barrier``): each agent whose workers succeeded adds 1 to
# ``<prefix>/num_members``; the one that reaches ``group_world_size`` sets
# ``<prefix>/last_member``, on which all wait (300 s). The agents' store is the round's
# ``PrefixStore`` (dynamic_rendezvous ``_wrap_store``), which joins prefix and key with "/".
EXIT_BARRIER_KEY = "torchelastic/agent/terminal_state/last_member"
_BARRIER_VALUE = b"<val_ignored>"


def exit_barrier_key(keys: JobKeys, round_: int) -> str:
    """The etcd key of round ``round_``'s exit-barrier release in the agents' store."""
    return f"{keys.store}torch.rendezvous.{keys.job_id}.{round_}/{EXIT_BARRIER_KEY}"


def release_exit_barrier(client: EtcdClient, keys: JobKeys, round_: int,
                         deadline_s: float = 1.0) -> bool:
    """Release round ``round_``'s exit barrier; True if this call set it.

    After an in-place shrink the lost nodes' agents never reach the barrier, so the
    survivors would wait its whole timeout at the job's end. Fenced: only while the
    rendezvous state is still at that round (a newer round's agents wait under another
    prefix), and only if absent (the key is torch's; an agent may have set it). The key
    lives on the run's lease, as the agents' own store keys do. ``deadline_s`` bounds the
    call; an outage raises ``EtcdError`` at once.
    """
    with no_retry(), deadline(deadline_s):
        kv = client.get(keys.rdzv_round) or client.get(keys.rdzv_state)
        if kv is None or _round_of(kv, keys) != round_:
            return False
        won, _ = client.put_or_create(exit_barrier_key(keys, round_), _BARRIER_VALUE, None,
                                      lease=kv.lease_id or None)
    if won:
        log.info("released the exit barrier of the old round", round=round_)
    return won


def current_round(client: EtcdClient, keys: JobKeys) -> RoundView | None:
    """The rendezvous round of either layout, with its epoch (the one the workers'
    generations carry: keyed rounds' ``rdzv/epoch``, else torch's in the run's store)."""
    found, _ = client.get_many([keys.rdzv_round, keys.rdzv_closed, keys.rdzv_state,
                                keys.rdzv_epoch, keys.store_epoch])
    epoch_kv = found.get(keys.rdzv_epoch) or found.get(keys.store_epoch)
    epoch = epoch_kv.value.decode("utf-8", "replace") if epoch_kv is not None else None
    pointer = found.get(keys.rdzv_round)
    if pointer is None:
        kv = found.get(keys.rdzv_state)
        return None if kv is None else replace(state_ops.view(kv.value, keys.rdzv_state),
                                               epoch=epoch)
    round_, _ = decode_pointer(pointer.value, pointer.key)
    world = _keyed_world(client, keys, round_)
    members = world.members if world is not None else ()
    return RoundView(round_, world is not None, keys.rdzv_closed in found,
                     tuple((m.addr, m.pid) for m in members),
                     count_joins(client, keys, round_ + 1, _quiet, remove=False), epoch)


def _quiet(kv: KeyValue, problem: str) -> None:
    """A reader's view says nothing of the keys it does not count (the agents warn)."""


def _round_of(kv: KeyValue, keys: JobKeys) -> int:
    if kv.key == keys.rdzv_round:
        return decode_pointer(kv.value, kv.key)[0]
    return state_ops.view(kv.value, keys.rdzv_state).round


def _keyed_world(client: EtcdClient, keys: JobKeys, round_: int) -> World | None:
    kv = client.get(keys.rdzv_world(round_))
    return None if kv is None else World.decode(kv.value, kv.key)


def _evict_keyed(client: EtcdClient, keys: JobKeys, agents: set[tuple[str, int]],
                 deadline_s: float) -> Removal | None:
    """Keyed rounds: revoke each agent's liveness lease; None if the job is not keyed."""
    with no_retry(), deadline(deadline_s):
        pointer = client.get(keys.rdzv_round)
        alive, _ = client.list_prefix(keys.rdzv_alive)
        if pointer is None and not alive:
            return None
        found = [(kv, Agent.from_json(json.loads(kv.value))) for kv in alive
                 if _agent_of(kv) in agents]
        for kv, _agent in found:
            client.revoke_lease(kv.lease_id)
        removed = tuple(agent.name for _, agent in found)
        world = None if pointer is None else _keyed_world(
            client, keys, decode_pointer(pointer.value, pointer.key)[0])
    in_round = world is not None and any(world.rank_of(a) is not None for _, a in found)
    return Removal(None, removed, in_round)


def _agent_of(kv: KeyValue) -> tuple[str, int] | None:
    try:
        agent = Agent.from_json(json.loads(kv.value))
    except (ValueError, TypeError):
        return None     # not ours to judge here: the agents' reads log it
    return agent.addr, agent.pid
