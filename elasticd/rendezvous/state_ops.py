"""Small pure operations on torch's dynamic-rendezvous state, as stored in etcd.

The state is torch's ``_RendezvousState`` pickled by the agents themselves. Anyone who
can write the job's prefix in etcd can write that key, so it is never handed to a plain
``pickle.loads``: ``decode`` (and the backend, before torch sees a value) admits only the
few classes torch's state is made of (``load_state``). The daemon uses these operations
to evict a dead node's agent at once instead of waiting for torch's keep-alive eviction
(15 s by default), and to reopen a state an agent closed.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from datetime import datetime
from types import SimpleNamespace
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.errors import EtcdError

# Every global a pickled ``_RendezvousState`` refers to at protocol 3 or later (torch
# pickles with the default protocol, 4): the two torch classes, the datetime types of the
# deadline and heartbeats, and set/frozenset (protocol 3 pickles a set by its class).
# Nothing else is ever looked up, so a crafted value cannot reach os.system & co.
_ALLOWED_GLOBALS = frozenset({
    (dyn.__name__, "_RendezvousState"),
    (dyn.__name__, "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
})


class CorruptStateError(RendezvousStateError, EtcdError):
    """The rendezvous state in etcd is not one torch's agents wrote (corrupt or tampered).

    A torch ``RendezvousStateError`` (what torch's own backends raise for a corrupt
    state, so the agent reports it the usual way) and an ``EtcdError`` (what the
    daemon already handles for every read of etcd).
    """


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of a rendezvous state")
        return super().find_class(module, name)


def load_state(state_bytes: bytes, key: str = "<key_prefix>/<job>/rdzv/state") -> dyn._RendezvousState:
    """Unpickle a rendezvous state admitting only the classes it is made of.

    Raises ``CorruptStateError`` naming ``key`` and the fix for anything else: a
    value with other globals (code execution), a truncated pickle, or a pickle of the
    allowed classes in a shape torch would not have written.
    """
    try:
        state = _RestrictedUnpickler(io.BytesIO(state_bytes)).load()
        _check_shape(state)
    except Exception as exc:  # any failure of an untrusted value means the same thing
        raise CorruptStateError(
            f"the rendezvous state at {key} is not a state torch's agents wrote (corrupt or "
            f"tampered with: {exc}); it was not loaded. Stop the job's agents and delete the "
            f"key (etcdctl del {key}); the next agent starts a fresh rendezvous"
        ) from None
    return state


def _check_shape(state: Any) -> None:
    if type(state) is not dyn._RendezvousState:
        raise ValueError(f"top-level object is a {type(state).__name__}, not a _RendezvousState")
    checks = {
        "round": isinstance(state.round, int),
        "complete": isinstance(state.complete, bool),
        "closed": isinstance(state.closed, bool),
        "deadline": state.deadline is None or isinstance(state.deadline, datetime),
        "participants": isinstance(state.participants, dict) and all(
            _is_node(n) and isinstance(r, int) for n, r in state.participants.items()),
        "wait_list": isinstance(state.wait_list, set) and all(map(_is_node, state.wait_list)),
        "redundancy_list": isinstance(state.redundancy_list, set) and all(
            map(_is_node, state.redundancy_list)),
        "last_heartbeats": isinstance(state.last_heartbeats, dict) and all(
            _is_node(n) and isinstance(t, datetime) for n, t in state.last_heartbeats.items()),
    }
    bad = [name for name, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"fields of the wrong type: {', '.join(bad)}")


def _is_node(node: Any) -> bool:
    return (type(node) is dyn._NodeDesc and isinstance(node.addr, str)
            and isinstance(node.pid, int) and isinstance(node.local_id, int))


@dataclass(frozen=True)
class RoundView:
    """What status and decisions need from the state, without torch types."""

    round: int
    complete: bool
    closed: bool
    participants: tuple[tuple[str, int], ...]   # (addr, agent pid), ordered by rank
    waiting: int
    epoch: str | None = None    # the rendezvous epoch, where the reader knows it (admin.current_round)

    @property
    def world_nodes(self) -> int:
        return len(self.participants) if self.complete else 0


def decode(state_bytes: bytes, key: str = "<key_prefix>/<job>/rdzv/state") -> dyn._RendezvousState:
    """The state, loaded safely (``load_state``); ``CorruptStateError`` if it is not one."""
    return load_state(state_bytes, key)


def view(state_bytes: bytes, key: str = "<key_prefix>/<job>/rdzv/state") -> RoundView:
    state = decode(state_bytes, key)
    ordered = sorted(state.participants.items(), key=lambda item: item[1])
    return RoundView(state.round, state.complete, state.closed,
                     tuple((node.addr, node.pid) for node, _ in ordered), len(state.wait_list))


@dataclass(frozen=True)
class Removal:
    state: bytes | None          # the new encoded state; None if nothing changed
    removed: tuple[str, ...]     # torch node names removed
    in_round: bool               # one of them was a participant of the current round


def remove_agents(state_bytes: bytes, agents: set[tuple[str, int]], min_nodes: int,
                  key: str = "<key_prefix>/<job>/rdzv/state") -> Removal:
    """Remove every node whose (addr, agent pid) is in ``agents``.

    Applies torch's own epilogue, so a complete round left without participants
    moves to the next round exactly as torch would move it.
    """
    state = decode(state_bytes, key)
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


def reopen(state_bytes: bytes, key: str = "<key_prefix>/<job>/rdzv/state") -> bytes | None:
    """The state with ``closed`` cleared, or None if it is not closed.

    torch closes the rendezvous for good when any agent shuts down (it gave up after
    ``--max-restarts``, or a join timed out); every agent then fails with
    ``RendezvousClosedError``. Reopening changes nothing else: the round, its
    participants and the waiting nodes stay as they are, and torch's rules go on.
    """
    state = decode(state_bytes, key)
    if not state.closed:
        return None
    state.closed = False
    return pickle.dumps(state)
