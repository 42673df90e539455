"""Fenced edits of the live rendezvous state by the daemon (not by torch).

Every edit is read-modify-write with a compare on the key's mod_revision, so
it never overwrites an agent's concurrent update: on a lost race it re-reads
and re-applies the (idempotent) pure operation.
"""

from __future__ import annotations

import structlog

from elasticd.etcd_client import EtcdClient
from elasticd.rendezvous import state_ops
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.state_ops import Removal, RoundView

log = structlog.get_logger(__name__)

_MAX_ATTEMPTS = 20


def evict_agents(client: EtcdClient, keys: JobKeys, agents: set[tuple[str, int]],
                 min_nodes: int) -> Removal:
    """Remove these agents from the rendezvous at once (instead of after torch's keep-alive)."""
    for _ in range(_MAX_ATTEMPTS):
        kv = client.get(keys.rdzv_state)
        if kv is None:
            return Removal(None, (), False)
        removal = state_ops.remove_agents(kv.value, agents, min_nodes)
        if removal.state is None:
            return removal
        won, _ = client.put_or_create(keys.rdzv_state, removal.state, kv.mod_revision,
                                      lease=kv.lease_id or None)
        if won:
            return removal
    log.warning("gave up evicting agents after repeated races", agents=sorted(agents))
    return Removal(None, (), False)


def current_round(client: EtcdClient, keys: JobKeys) -> RoundView | None:
    kv = client.get(keys.rdzv_state)
    return None if kv is None else state_ops.view(kv.value)
