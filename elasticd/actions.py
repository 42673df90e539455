"""The action vocabulary of elasticd's loops: each cycle observes, decides purely and
returns ``Action``s, which one table of executors carries out. The daemon's policy
(``supervisor.decide``, executed by ``daemon.ACTIONS``) and plain torchrun's recovery
companion (``rendezvous/companion.py``, its own table) speak it; it imports nothing of
either, so the plugin can use it inside torchrun's agent."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Kind(enum.Enum):
    """Every action the daemon can take; ``daemon.ACTIONS`` maps each to its executor.

    The torchrun companion's loop (``rendezvous/companion.py``) speaks a subset of the
    same words (PUBLISH its record, EVICT condemned members' records, SHRINK,
    WRITE_GENERATION) with executors of its own."""

    START_AGENT = "start_agent"                # data: enter (a live generation: a join in place)
    TERMINATE_AGENT = "terminate_agent"        # SIGTERM the agent's tree (drain)
    KILL_AGENT = "kill_agent"                  # SIGKILL the agent's tree
    KILL_WORKERS = "kill_workers"              # data: pids
    CONFIRM_PEER = "confirm_peer"              # probe a vanished peer once, off the loop; data: peer
    EVICT = "evict"                            # remove dead peers' agents from the rendezvous; data: peers
    LEAVE_RENDEZVOUS = "leave_rendezvous"      # remove our own agent
    REOPEN_RENDEZVOUS = "reopen_rendezvous"    # a closed rendezvous of an unfinished job
    PUBLISH = "publish"                        # fields of this node's record; data: fields
    JOURNAL = "journal"                        # data: event, fields
    COUNT = "count"                            # a metric; data: metric, label
    OBSERVE = "observe"                        # a histogram sample; data: metric, label, value
    MARK_COMPLETED = "mark_completed"          # the job's /state = completed
    PUBLISH_CHECKPOINT = "publish_checkpoint"  # data: step
    TOUCH_STOP_FILE = "touch_stop_file"        # the workers' coordinated-stop flag
    DELETE_DRAIN_KEY = "delete_drain_key"
    NOTIFY = "notify"                          # systemd; data: what (ready | stopping)
    SHRINK = "shrink"                          # agree the next generation without lost nodes;
    #                                            data: lost, cause, peers, generation
    WRITE_GENERATION = "write_generation"      # hand an agreed record to our workers; data: record
    DRAIN_IN_PLACE = "drain_in_place"          # agree a planned generation without this node,
    #                                            hand it to our workers; data: generation
    GROW_IN_PLACE = "grow_in_place"            # agree a planned generation with this node
    #                                            (its workers warm), hand it to them; data: live


@dataclass(frozen=True)
class Action:
    kind: Kind
    data: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __getitem__(self, key: str) -> Any:
        return self.data[key]


def act(kind: Kind, **data: Any) -> Action:
    return Action(kind, MappingProxyType(data))


@dataclass(frozen=True)
class Outcome:
    """What an executor did, for the cycle's one log line to name: ``text`` is a clause of its
    sentence ("evicted b's agent from round 4"), ``fields`` join the line's structured fields
    (what log readers match on), and a ``failed`` outcome makes the line a warning."""

    text: str
    fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    failed: bool = False
