"""Whether an agreed generation record is one our workers may enter: what it says, checked
against what each node says of itself in its own record.

Whoever can write the job's ``generation`` key names the group the workers re-form into
and the TCP store they form through. Issue 27 put one record there naming a foreign
process and a store it hosted: the process joined as rank 1, claimed the newest step,
handed the survivor a state of its own weights, and rank 0 committed it as a verified
checkpoint. A record is now entered, built on, or allowed to fence anyone out only if:

* every member has a live record of its own (a node record under the daemon, a companion
  record under plain torchrun): a member of the workers' round reports a world of that
  round; a member new in it is among the record's ``joined`` and its record says its
  newcomers wait to enter that round (a join, or a warm spare), or are in it already;
* the store is the one rank 0's node publishes: the rule ``generation.shrink`` and
  ``grow`` follow (a group forms through the store of its rank 0's host).

The daemon (its cycle's snapshot and its agreement) and the companion (its backstop and
its agreement) take the rule from here. It turns a forgery from one put into a
consistent set of node records on their owners' leases; a holder of a daemon's etcd
credentials can still make those (docs/security.md says what protects them). A check
that fails on a legitimate record (a newcomer's record not yet in this reader's view) is
made again at the next read: the record is not handed meanwhile, never overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from elasticd.contract.generation import GenerationId, GenerationRecord


@dataclass(frozen=True)
class Roster:
    """What the live nodes' own records say, as one reader saw them (ours included)."""

    stores: Mapping[str, str] = field(default_factory=dict)           # node -> its store
    worlds: Mapping[str, GenerationId] = field(default_factory=dict)  # node -> its workers'
    entering: Mapping[str, GenerationId] = field(default_factory=dict)  # node -> the world
    # its newcomers wait to enter


def refusal(record: GenerationRecord, roster: Roster) -> str | None:
    """Why no worker may take ``record`` (None: they may); see the module docstring."""
    round_ = record.id
    for member in record.members:
        node = member.node
        if node in record.joined:
            # Entering, or already entered (its newcomers report a world of the round once
            # they are in, and its daemon clears ``entering``: a slower member reads that).
            live = roster.entering.get(node) or roster.worlds.get(node)
            if live is None or not live.same_round(round_):
                return (f"it names {node} among the joined, but no record of {node} says its "
                        f"newcomers wait to enter round {round_.round} or are in it")
        else:
            world = roster.worlds.get(node)
            if world is None or not world.same_round(round_):
                return (f"it names {node} a member, but no live record of {node} reports a "
                        f"world of round {round_.round}")
    rank0 = record.members[0].node
    published = roster.stores.get(rank0)
    if record.store is None or record.store != published:
        return (f"its store {record.store} is not the one its rank 0's node {rank0} "
                f"publishes ({published or 'none'})")
    return None
