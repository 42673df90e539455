"""Who is dead is decided by a majority: the pure rules over the suspicions in the records.

A failed probe proves little on its own: a refused one (a TCP reset) comes as well from
a dead daemon as from a firewall that rejects, and a silent one from a frozen node as
from a dropped link. So one daemon's failed probe is only its *suspicion*, published in
its own node record (``suspects``), and every daemon that sees a peer suspected probes
that peer too (``Prober``). A peer is *condemned* (evicted, its world shrunk without it)
only when a strict majority of the job's live members (every node with a record, this
one included) suspect it. A node that suspects so many that the members it still
reaches are a strict minority is *isolated*: it condemns nobody, stops its own workers
and waits (the others are the majority; it must never fence them out). A peer whose
record vanished (its lease expired: etcd's own majority decided) needs no votes.

Measured before these rules (issue 29): a node behind a REJECT cut took its refused
probes as certain deaths, agreed a generation without the two healthy nodes 0.2 s into
the cut, trained alone and deleted their records 364 times in 90 s.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Protocol


class Suspecting(Protocol):
    """A peer's record as far as the votes go (``supervisor.PeerView``)."""

    @property
    def suspects(self) -> frozenset[str]: ...


def live_members(me: str, peers: Mapping[str, Suspecting]) -> frozenset[str]:
    """Every node of the job with a record: the electorate."""
    return frozenset(peers) | {me}


def votes(target: str, me: str, mine: Set[str], peers: Mapping[str, Suspecting]) -> int:
    """How many live members suspect ``target`` (``mine``: this node's suspects)."""
    others = sum(1 for node, peer in peers.items() if node != target and target in peer.suspects)
    return others + (1 if target in mine and target != me else 0)


def condemned(me: str, mine: Set[str], peers: Mapping[str, Suspecting]) -> frozenset[str]:
    """The peers a strict majority of the live members suspect; none while this node is
    isolated (a minority's votes never count against the majority)."""
    if isolated(me, mine, peers):
        return frozenset()
    size = len(live_members(me, peers))
    return frozenset(n for n in peers if 2 * votes(n, me, mine, peers) > size)


def isolated(me: str, mine: Set[str], peers: Mapping[str, Suspecting]) -> bool:
    """This node reaches only a strict minority of the live members (itself included)."""
    size = len(live_members(me, peers))
    reached = size - len(set(mine) & set(peers))
    return 2 * reached < size
