"""The probe ring: each daemon probes a bounded set of peers, every node stays watched."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.config import NodeConfig
from elasticd.errors import ConfigError
from elasticd.probe import Prober, ring_successors

NODE_IDS = st.sets(st.text("abcdefghij0123456789-", min_size=1, max_size=6), min_size=1,
                   max_size=40)


@given(NODE_IDS, st.integers(0, 6))
def test_every_node_is_probed_by_min_k_others_and_nobody_probes_itself(ids, k):
    probed_by: Counter[str] = Counter()
    for me in ids:
        targets = ring_successors(me, ids, k)
        assert me not in targets and len(set(targets)) == len(targets)
        want = len(ids) - 1 if k == 0 else min(k, len(ids) - 1)
        assert len(targets) == want  # bounded by k whatever the number of nodes
        probed_by.update(targets)
    watchers = len(ids) - 1 if k == 0 else min(k, len(ids) - 1)
    assert all(probed_by[node] == watchers for node in ids)


def test_the_ring_wraps_in_node_id_order_and_skips_peers_that_are_gone():
    ids = ["a", "b", "c", "d", "e"]
    assert ring_successors("d", ids, 2) == ["e", "a"]
    assert ring_successors("c", ["a", "b", "d", "e"], 2) == ["d", "e"]  # c's record is gone
    assert ring_successors("a", ids, 0) == ["b", "c", "d", "e"]


class _Peer:
    def __init__(self, node_id: str, probe: str | None) -> None:
        self.node_id, self.probe = node_id, probe


def test_the_prober_probes_its_ring_successors_among_peers_with_a_probe():
    peers = {n: _Peer(n, f"127.0.0.1:{i + 1}" if n != "c" else None)
             for i, n in enumerate("abcdef")}
    ring = Prober(lambda: peers, interval_s=1, me="b", neighbours=2)
    everyone = Prober(lambda: peers, interval_s=1)
    assert [p.node_id for p in ring.targets()] == ["d", "e"]  # c publishes no probe
    assert [p.node_id for p in everyone.targets()] == ["a", "b", "d", "e", "f"]


def test_a_bad_neighbour_count_is_refused_with_the_fix():
    assert NodeConfig(id="n1").probe_neighbours == 2
    with pytest.raises(ConfigError, match=r"node.probe_neighbours = -1 .*whole number >= 0"):
        NodeConfig(id="n1", probe_neighbours=-1)
