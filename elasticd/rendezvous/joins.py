"""Which keys under a keyed round's ``join/<round>/`` count as an agent's join.

Every agent of a round reads them: the leader to decide, the followers to find the
leader, the members to count the nodes waiting, the daemon for ``status``. One rule for
all of them, here: a key counts only if an agent of this plugin can have written it and
that agent is alive.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from elasticd.etcd_client import EtcdClient, KeyValue
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.rounds import Agent, Joined

Warn = Callable[[KeyValue, str], None]


def read_joins(client: EtcdClient, keys: JobKeys, round_: int, warn: Warn,
               remove: bool = True) -> tuple[tuple[Joined, ...], int]:
    """Round ``round_``'s joins that count, oldest first, and the revision they were read at.

    A join counts only if it is on a lease, holds an agent whose name is its key's, and
    that agent's liveness key exists. Any other key under ``join/`` (a stray ``etcdctl
    put``, a forgery) neither waits nor leads: one stray key under the next round made
    every agent stop for a "waiting node" and lead nothing, so the round never closed and
    every daemon failed 5 join timeouts later. A key that no agent of this plugin can have
    written (on no lease, or not an agent of its name) is also removed, fenced on its
    revision (unless ``remove`` is False: a reader's view writes nothing); ``warn`` says
    so.
    """
    prefix = keys.rdzv_joins(round_)
    kvs, revision = client.list_prefix(prefix)
    candidates: list[Joined] = []
    for kv in kvs:
        problem, joined = _join_problem(kv, prefix)
        if joined is not None:
            candidates.append(joined)
            continue
        if remove:
            warn(kv, f"a join key that no agent wrote ({problem}); removed")
            client.delete_if_revision(kv.key, kv.mod_revision)
    if not candidates:
        return (), revision
    found, _ = client.get_many([keys.rdzv_alive + j.agent.name for j in candidates])
    live = [j for j in candidates if keys.rdzv_alive + j.agent.name in found]
    for j in candidates:
        if j not in live:
            warn(KeyValue(prefix + j.agent.name, b"", 0, j.create_revision, 0),
                 "a join of an agent with no liveness key; not counted")
    return tuple(sorted(live, key=lambda j: j.create_revision)), revision


def oldest_join(client: EtcdClient, keys: JobKeys, round_: int, warn: Warn,
                mine: Agent | None = None) -> Agent | None:
    """The agent of round ``round_``'s oldest join that counts (its leader), or None. One
    read of the oldest key, and one of its agent's liveness unless it is ``mine`` (the
    caller's own, which it keeps alive), while that key counts, as it does but for a stray
    or forged one; else every join is read (``read_joins``)."""
    prefix = keys.rdzv_joins(round_)
    first = client.first_created(prefix)
    if first is None:
        return None
    _, joined = _join_problem(first, prefix)
    if joined is not None and (joined.agent == mine or client.get(
            keys.rdzv_alive + joined.agent.name) is not None):
        return joined.agent
    joins, _ = read_joins(client, keys, round_, warn)
    return joins[0].agent if joins else None


def count_joins(client: EtcdClient, keys: JobKeys, round_: int, warn: Warn,
                remove: bool = True) -> int:
    """How many joins to ``round_`` count (``read_joins``): one count-only read while
    there are none, as at steady state."""
    if client.count_prefix(keys.rdzv_joins(round_)) == 0:
        return 0
    return len(read_joins(client, keys, round_, warn, remove)[0])


def _join_problem(kv: KeyValue, prefix: str) -> tuple[str, Joined | None]:
    """Why ``kv`` is not an agent's join key (and None), or ("", its join)."""
    if not kv.lease_id:
        return "on no lease", None
    try:
        agent = Agent.from_json(json.loads(kv.value))
    except (ValueError, TypeError) as exc:
        return f"not an agent: {exc}", None
    if kv.key != prefix + agent.name:
        return f"it holds agent {agent.name}, not the one its key names", None
    return "", Joined(agent, kv.create_revision)
