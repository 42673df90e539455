"""Small pure operations on torch's dynamic-rendezvous state, as stored in etcd.

The state is torch's ``_RendezvousState`` pickled by the agents themselves;
only agents and daemons of the same job write that key. The daemon uses these
to evict a dead node's agent at once instead of waiting for torch's keep-alive
eviction (15 s by default), which would block the next round that long.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from types import SimpleNamespace

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn


@dataclass(frozen=True)
class RoundView:
    """What status and decisions need from the state, without torch types."""

    round: int
    complete: bool
    closed: bool
    participants: tuple[tuple[str, int], ...]   # (addr, agent pid), ordered by rank
    waiting: int

    @property
    def world_nodes(self) -> int:
        return len(self.participants) if self.complete else 0


def decode(state_bytes: bytes) -> dyn._RendezvousState:
    return pickle.loads(state_bytes)


def view(state_bytes: bytes) -> RoundView:
    state = decode(state_bytes)
    ordered = sorted(state.participants.items(), key=lambda item: item[1])
    return RoundView(state.round, state.complete, state.closed,
                     tuple((node.addr, node.pid) for node, _ in ordered), len(state.wait_list))


@dataclass(frozen=True)
class Removal:
    state: bytes | None          # the new encoded state; None if nothing changed
    removed: tuple[str, ...]     # torch node names removed
    in_round: bool               # one of them was a participant of the current round


def remove_agents(state_bytes: bytes, agents: set[tuple[str, int]], min_nodes: int) -> Removal:
    """Remove every node whose (addr, agent pid) is in ``agents``.

    Applies torch's own epilogue, so a complete round left without participants
    moves to the next round exactly as torch would move it.
    """
    state = decode(state_bytes)
    removed = []
    in_round = False
    for node in list(state.last_heartbeats) + list(state.participants) + list(state.wait_list) + list(
            state.redundancy_list):
        if (node.addr, node.pid) not in agents or repr(node) in removed:
            continue
        in_round |= node in state.participants
        state.participants.pop(node, None)
        state.last_heartbeats.pop(node, None)
        state.wait_list.discard(node)
        state.redundancy_list.discard(node)
        removed.append(repr(node))
    if not removed:
        return Removal(None, (), False)
    if in_round:
        dyn._remove_participant_epilogue(state, SimpleNamespace(min_nodes=min_nodes))
    return Removal(pickle.dumps(state), tuple(removed), in_round)
