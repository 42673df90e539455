"""Pure edits of torch's rendezvous state, checked against torch's own state type."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.rendezvous.state_ops import CorruptStateError, decode, remove_agents, reopen, view


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


# -- reopen ------------------------------------------------------------------------------

def test_reopen_clears_closed_and_nothing_else():
    raw = dyn._RendezvousState()
    raw.round, raw.complete, raw.closed = 7, True, True
    raw.participants = {node("a", 1): 0}
    out = pickle.loads(reopen(pickle.dumps(raw)))
    assert not out.closed and out.round == 7 and out.complete and out.participants == raw.participants


def test_reopen_of_an_open_state_changes_nothing():
    assert reopen(state([node("a", 1)])) is None


# -- the restricted unpickler ------------------------------------------------------------

class _Evil:
    """What an attacker with write access to the job prefix would store."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_state_runs_no_code_and_names_the_key_and_the_fix(tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    for op in (view, lambda b: remove_agents(b, {("a", 1)}, 1), reopen, decode):
        with pytest.raises(CorruptStateError, match="open is not part of a rendezvous state"):
            op(evil)
    with pytest.raises(RendezvousStateError, match=r"etcdctl del /elasticd/j/rdzv/state"):
        decode(evil, "/elasticd/j/rdzv/state")
    assert not marker.exists()


def test_a_crafted_object_inside_a_real_state_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    raw = dyn._RendezvousState()
    raw.participants = {node("a", 1): 0}
    raw.wait_list = {_Evil(str(marker))}   # unhashable by torch, but pickle does not care
    with pytest.raises(CorruptStateError):
        view(pickle.dumps(raw))
    assert not marker.exists()


@pytest.mark.parametrize("bad", [
    pickle.dumps({"round": 1}),                              # allowed types, wrong shape
    pickle.dumps(dyn._NodeDesc("a", 1, 0)),
    b"not a pickle",
    state([node("a", 1)])[:-5],                              # truncated
])
def test_values_torch_would_not_write_are_refused(bad):
    with pytest.raises(CorruptStateError, match="not a state torch's agents wrote"):
        view(bad)


def test_wrongly_typed_fields_are_refused():
    raw = dyn._RendezvousState()
    raw.participants = {"not-a-node": 0}
    with pytest.raises(CorruptStateError, match="participants"):
        view(pickle.dumps(raw))


def test_every_protocol_torch_could_use_loads():
    raw = dyn._RendezvousState()
    raw.participants = {node("a", 1): 0}
    raw.wait_list = {node("b", 2)}
    raw.last_heartbeats = {node("a", 1): datetime.now(UTC)}
    raw.deadline = datetime.now()
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):
        assert view(pickle.dumps(raw, protocol=protocol)).participants == (("a", 1),)
