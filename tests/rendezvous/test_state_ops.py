"""Pure edits of torch's rendezvous state, checked against torch's own state type."""

from __future__ import annotations

import pickle
from datetime import datetime

from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.rendezvous.state_ops import remove_agents, view


def node(addr: str, pid: int) -> dyn._NodeDesc:
    return dyn._NodeDesc(addr, pid, 0)


def state(participants, complete=True, waiting=(), round_=4) -> bytes:
    s = dyn._RendezvousState()
    s.round, s.complete = round_, complete
    for rank, n in enumerate(participants):
        s.participants[n] = rank
        s.last_heartbeats[n] = datetime.now()
    for n in waiting:
        s.wait_list.add(n)
        s.last_heartbeats[n] = datetime.now()
    return pickle.dumps(s)


def test_view_lists_participants_by_rank():
    v = view(state([node("10.0.0.2", 7), node("10.0.0.1", 9)], waiting=[node("10.0.0.3", 3)]))
    assert v.participants == (("10.0.0.2", 7), ("10.0.0.1", 9))
    assert (v.round, v.complete, v.waiting, v.world_nodes) == (4, True, 1, 2)


def test_removing_a_participant_of_a_complete_round():
    a, b, c = node("a", 1), node("b", 2), node("c", 3)
    out = remove_agents(state([a, b, c]), {("b", 2)}, min_nodes=1)
    assert out.removed == ("b_2_0",) and out.in_round
    s = pickle.loads(out.state)
    assert set(s.participants) == {a, c} and b not in s.last_heartbeats
    assert s.complete and s.round == 4


def test_last_participant_removed_moves_to_the_next_round_like_torch():
    dead = node("b", 2)
    out = remove_agents(state([dead], waiting=[node("a", 1), node("c", 3)]), {("b", 2)}, min_nodes=2)
    s = pickle.loads(out.state)
    assert not s.complete and s.round == 5
    assert len(s.wait_list) == 2


def test_incomplete_round_below_min_nodes_clears_the_deadline():
    a, b = node("a", 1), node("b", 2)
    raw = dyn._RendezvousState()
    raw.participants = {a: 0, b: 1}
    raw.deadline = datetime.now()
    out = remove_agents(pickle.dumps(raw), {("b", 2)}, min_nodes=2)
    assert pickle.loads(out.state).deadline is None


def test_waiting_node_removed_is_not_in_round():
    out = remove_agents(state([node("a", 1)], waiting=[node("b", 2)]), {("b", 2)}, min_nodes=1)
    assert out.removed == ("b_2_0",) and not out.in_round


def test_unknown_agent_changes_nothing():
    out = remove_agents(state([node("a", 1)]), {("a", 99)}, min_nodes=1)
    assert out.state is None and out.removed == ()
