"""A join in place (issue 26), the newcomer's daemon: its rules without processes
(``supervisor.joining``; the end-to-end runs are in test_inplace_runs)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.actions import Kind
from elasticd.contract.generation import (
    Entering,
    GenerationId,
    GenerationRecord,
    WorldView,
    grow,
    renumber,
)
from elasticd.contract.progress import Progress
from elasticd.contract.settings import IN_PLACE
from elasticd.inplace.agreement import ShrinkOutcome
from elasticd.supervisor import Memory, Phase, Policy, Snapshot, decide
from elasticd.supervisor.reform import plan_shrink
from elasticd.supervisor.state import Death, Eviction, PeerView

T = 1000.0
AGENT = 4242
POLICY = Policy(recovery_mode=IN_PLACE, join_in_place=True, max_nodes=4, recovery_bound_s=5.0,
                join_warm_timeout_s=60.0)
G = GenerationId(3, 0, "ep")
B = PeerView("b", "running", ("127.0.0.2", 77), 5, "127.0.0.2:9", WorldView("b", G, 0, 1, 2),
             "127.0.0.2:29601")
C = PeerView("c", "running", ("127.0.0.3", 78), 6, "127.0.0.3:9", WorldView("c", G, 1, 1, 2),
             "127.0.0.3:29601")
PEERS = {"b": B, "c": C}
LIVE = GenerationRecord(G, renumber([("b", 1), ("c", 1)]))
GROWN = grow(LIVE, [("a", 1)], "127.0.0.2:29601")


def snap(**kw) -> Snapshot:
    kw.setdefault("now", T)
    kw.setdefault("node_id", "a")
    kw.setdefault("peers", PEERS)
    kw.setdefault("round", 3)
    return Snapshot(**kw)


def started(policy: Policy = POLICY, **kw) -> Memory:
    """The memory after the start rule, checked: the agent enters G in place."""
    out = decide(snap(**kw), Memory(), policy)
    assert out.kinds() == [Kind.START_AGENT, Kind.PUBLISH, Kind.NOTIFY] and out.actions[0]["enter"] == G
    assert out.actions[1]["fields"] == {"entering": {"generation": G.as_dict(), "warm": False, "nproc": 1}}
    assert "to enter generation 3.0 in place" in out.reason
    return out.memory


def warm(**kw) -> Snapshot:
    kw.setdefault("agent_pid", AGENT)
    kw.setdefault("workers", frozenset({11}))
    kw.setdefault("progress_event", "warm")
    kw.setdefault("step", 0)
    kw.setdefault("generation", G)
    return snap(**kw)


def test_a_new_node_of_a_live_in_place_world_starts_its_agent_to_enter_it():
    m = started()
    assert (m.life.joining, m.life.joining_since) == (G, T)


def test_a_newcomer_waiting_for_its_warm_server_says_at_once_that_it_will_enter():
    # Another node's warm newcomer then waits for ours (join_batch_s): one generation
    # for both, as when both agents started at once (seen: two joins entered one by one).
    out = decide(snap(warm_server="importing", warm_server_age_s=2.0), Memory(), POLICY)
    assert out.kinds() == [Kind.PUBLISH] and "warm-start server's imports" in out.reason
    assert out.actions[0]["fields"] == {"entering": {"generation": G.as_dict(), "warm": False,
                                                     "nproc": 1}}
    assert decide(snap(warm_server="importing", warm_server_age_s=3.0), out.memory,
                  POLICY).actions == ()


@pytest.mark.parametrize("why, policy, kw", [
    ("switched off (or not keyed rounds)", replace(POLICY, join_in_place=False), {}),
    ("no live world published", POLICY, {"peers": {"b": replace(B, world=None)}}),
    ("a world the records do not cover", POLICY, {"peers": {"b": B}}),
    ("this node is still in that world", POLICY, {"node_id": "b"}),
    ("a newer round formed", POLICY, {"round": 4}),
])
def test_an_ordinary_round_where_a_join_cannot_run_in_place(why, policy, kw):
    out = decide(snap(**kw), Memory(), policy)
    assert out.actions[0].kind is Kind.START_AGENT and out.actions[0]["enter"] is None, why
    assert out.memory.life.joining is None


def test_the_agreed_generation_is_the_base_when_it_is_newer_than_the_records():
    shrunk = GenerationRecord(G.next(), renumber([("b", 1)]), "127.0.0.2:29601", ("c",))
    out = decide(snap(generation_record=shrunk), Memory(), POLICY)
    assert out.actions[0]["enter"] == G.next()


def test_warm_newcomers_propose_the_generation_with_this_node_once():
    m = started()
    out = decide(warm(now=T + 3), m, POLICY)
    assert out.kinds() == [Kind.PUBLISH, Kind.GROW_IN_PLACE] and out.actions[1]["live"] == G
    assert out.actions[0]["fields"]["entering"]["warm"] is True and out.actions[1]["others"] == ()
    again = decide(warm(now=T + 3.5), out.memory, POLICY)
    assert Kind.GROW_IN_PLACE not in again.kinds()


def test_a_warm_newcomer_is_no_step_no_world_and_no_hang():
    m = decide(warm(now=T + 3), started(), POLICY).memory
    assert m.life.step_at is None   # the hang timer waits for the entry
    assert decide(warm(now=T + 59), m.but(join_proposed=True), POLICY).actions == ()
    assert Progress(step=0, world_size=1, event="warm", rank=0, generation=G,
                    local_world_size=1).world("a") is None


def test_the_agreement_then_the_entry_journal_one_node_joined():
    m = decide(warm(now=T + 3), started(), POLICY).memory
    ok = ShrinkOutcome(("a",), "ok", GROWN, wrote=True)
    m = decide(warm(now=T + 3.2, grown=ok), m, POLICY).memory
    assert (m.reform.generation_handed, m.life.join_agreed_at) == (GROWN.id, T + 3.2)
    # The record, once etcd shows it, is ours already: not handed again, no fencing.
    assert decide(warm(now=T + 3.4, generation_record=GROWN), m, POLICY).actions == ()
    out = decide(warm(now=T + 4, progress_event="reformed", step=57, generation=GROWN.id,
                      world=WorldView("a", GROWN.id, 2, 1, 3)), m, POLICY)
    (journal,) = [a for a in out.actions if a.kind is Kind.JOURNAL]
    assert journal["event"] == "joined-in-place" and journal["fields"]["in_place"] is True
    assert journal["fields"]["join_s"] == 4.0 and journal["fields"]["world_size"] == 3
    assert out.memory.life.joining is None
    assert "entered generation 3.1 in place, 4.0 s after our agent started" in out.reason


def test_a_generation_without_us_while_we_enter_fences_nobody():
    lost_c = GenerationRecord(G.next(), renumber([("b", 1)]), "127.0.0.2:29601", ("c",))
    m = decide(warm(now=T + 3), started(), POLICY).memory
    out = decide(warm(now=T + 3.1, generation_record=lost_c), m, POLICY)
    assert Kind.KILL_WORKERS not in out.kinds() and Kind.WRITE_GENERATION not in out.kinds()


def test_a_world_that_changed_before_our_proposal_is_proposed_to_again():
    m = decide(warm(now=T + 3), started(), POLICY).memory
    shrunk = GenerationRecord(G.next(), renumber([("b", 1)]), "127.0.0.2:29601", ("c",))
    failed = ShrinkOutcome(("a",), "failed", shrunk, reason="the world changed first")
    out = decide(warm(now=T + 3.2, grown=failed, generation_record=shrunk), m, POLICY)
    assert out.memory.life.joining == G.next() and not out.memory.life.join_proposed
    assert "proposing it again" in out.reason
    out = decide(warm(now=T + 3.4, generation_record=shrunk), out.memory, POLICY)
    assert out.kinds() == [Kind.GROW_IN_PLACE] and out.actions[0]["live"] == G.next()


def newcomer(node: str, warm: bool, live: GenerationId = G) -> PeerView:
    return PeerView(node, "running", ("127.0.0.9", 90), 7, "127.0.0.9:9",
                    entering=Entering(node, live, warm, 1))


def test_a_warm_newcomer_takes_the_other_warm_newcomers_into_one_generation():
    peers = {**PEERS, "d": newcomer("d", True), "e": newcomer("e", True, GenerationId(2, 0, "ep"))}
    out = decide(warm(now=T + 3, peers=peers), started(peers=peers), POLICY)
    (grow_,) = [a for a in out.actions if a.kind is Kind.GROW_IN_PLACE]
    assert grow_["others"] == (("d", 1),)   # not e: it waits for a world of another round
    assert "with this node and d" in out.reason


def test_a_warm_newcomer_waits_for_one_not_warm_yet_then_proposes_with_it():
    peers = {**PEERS, "d": newcomer("d", False)}
    m = started(peers=peers)
    out = decide(warm(now=T + 3, peers=peers), m, POLICY)
    assert out.kinds() == [Kind.PUBLISH] and "waiting up to 5 s for the newcomers of d" in out.reason
    quiet = decide(warm(now=T + 4, peers=peers), out.memory, POLICY)
    assert quiet.actions == () and quiet.reason == ""
    warm_d = {**PEERS, "d": newcomer("d", True)}
    out = decide(warm(now=T + 5, peers=warm_d), quiet.memory, POLICY)
    assert out.kinds() == [Kind.GROW_IN_PLACE] and out.actions[0]["others"] == (("d", 1),)


@pytest.mark.parametrize("why, now, kw", [
    ("its bound passed", T + 8.1, {}),
    ("another newcomer's record names us already", T + 4,
     {"generation_record": grow(LIVE, [("a", 1), ("d", 1)])}),
])
def test_the_wait_for_another_newcomer_ends(why, now, kw):
    peers = {**PEERS, "d": newcomer("d", False)}
    m = decide(warm(now=T + 3, peers=peers), started(peers=peers), POLICY).memory
    out = decide(warm(now=now, peers=peers, **kw), m, POLICY)
    (grow_,) = [a for a in out.actions if a.kind is Kind.GROW_IN_PLACE]
    assert grow_["others"] == (), why


def test_newcomers_past_the_worlds_room_wait_for_a_later_generation():
    peers = {**PEERS, "d": newcomer("d", True), "e": newcomer("e", True)}
    out = decide(warm(now=T + 3, peers=peers), started(peers=peers), replace(POLICY, max_nodes=4))
    (grow_,) = [a for a in out.actions if a.kind is Kind.GROW_IN_PLACE]
    assert grow_["others"] == (("d", 1),)   # b, c, a, d: full


def _fell_back(out) -> None:
    assert out.kinds()[0] is Kind.KILL_AGENT, out.kinds()
    assert out.memory.life.agent_released and out.memory.life.join_fell_back
    assert out.memory.life.joining is None
    (journal,) = [a for a in out.actions if a.kind is Kind.JOURNAL]
    assert (journal["event"], journal["fields"]["fault"]) == ("in-place-fallback", "join")
    assert out.reason.startswith("the join in place fell back to an ordinary round")


def test_a_failed_agreement_falls_back_to_an_ordinary_round_counting_no_crash():
    m = decide(warm(now=T + 3), started(), POLICY).memory
    failed = ShrinkOutcome(("a",), "failed", reason="etcd did not answer: down")
    out = decide(warm(now=T + 3.2, grown=failed), m, POLICY)
    _fell_back(out)
    # The agent's exit is no failure; its next start joins an ordinary round.
    exited = decide(snap(now=T + 3.5, agent_pid=AGENT, agent_exit=-9), out.memory, POLICY)
    assert exited.phase is Phase.BACKOFF and not exited.memory.life.failures
    again = decide(snap(now=T + 3.6), exited.memory, POLICY)
    assert again.actions[0].kind is Kind.START_AGENT and again.actions[0]["enter"] is None


# Not warm: the warm bound (60 s); agreed: twice a planned change's bound, 2 x (5 + 2 s slack).
@pytest.mark.parametrize("proposed_at, agreed, now", [(None, False, T + 60), (T + 3, True, T + 3 + 14)])
def test_a_join_that_outlasts_its_bound_falls_back(proposed_at, agreed, now):
    m = started()
    if agreed:
        m = m.but(join_proposed=True, join_agreed_at=proposed_at)
    quiet = warm(now=now - 0.5, progress_event=None if not agreed else "warm")
    assert decide(quiet, m.but(join_proposed=True), POLICY).actions == ()
    _fell_back(decide(warm(now=now), m.but(join_proposed=True), POLICY))


def test_the_fall_back_is_cleared_once_our_workers_step():
    m = Memory.of(Phase.RUNNING, agent_pid=AGENT, workers=frozenset({12}), join_fell_back=True)
    out = decide(snap(agent_pid=AGENT, workers=frozenset({12}), progress_event="step", step=5,
                      generation=GenerationId(4, 0, "ep")), m, POLICY)
    assert not out.memory.life.join_fell_back


def test_newcomers_that_exit_before_their_entry_give_the_join_up():
    m = decide(warm(now=T + 3), started(), POLICY).memory
    assert m.life.workers == frozenset({11})
    out = decide(warm(now=T + 4, workers=frozenset({13}), progress_event=None), m, POLICY)
    assert out.memory.life.joining is None and out.memory.life.join_fell_back
    assert Kind.KILL_AGENT not in out.kinds()


# -- warm spares --------------------------------------------------------------------------

FULL = replace(POLICY, max_nodes=2)


def test_a_node_beyond_max_nodes_waits_warm_as_a_spare_for_as_long_as_it_takes():
    m = started(FULL)   # the agent enters the full world all the same
    out = decide(warm(now=T + 3), m, FULL)
    assert out.kinds() == [Kind.PUBLISH] and "wait as a spare for a lost node's place" in out.reason
    later = decide(warm(now=T + 3 + 10 * FULL.join_warm_timeout_s), out.memory, FULL)
    assert later.actions == () and later.memory.life.joining == G   # no bound while warm


def test_a_spare_proposes_a_join_once_the_world_has_room():
    m = decide(warm(now=T + 3), started(FULL), FULL).memory
    drained = GenerationRecord(G.next(), renumber([("b", 1)]), "127.0.0.2:29601", ("c",))
    b_alone = replace(B, world=WorldView("b", G.next(), 0, 1, 1))
    out = decide(warm(now=T + 9, generation_record=drained, peers={"b": b_alone}), m, FULL)
    (grow_,) = [a for a in out.actions if a.kind is Kind.GROW_IN_PLACE]
    assert grow_["live"] == G.next() and out.memory.life.joining == G.next()


def test_a_spare_taken_by_a_losss_generation_enters_it_and_says_whom_it_replaced():
    m = decide(warm(now=T + 3), started(FULL), FULL).memory
    taken = GenerationRecord(G.next(), renumber([("b", 1), ("a", 1)]), "127.0.0.2:29601", ("c",),
                             "peer-crashed", joined=("a",))
    out = decide(warm(now=T + 20, generation_record=taken), m, FULL)
    assert Kind.GROW_IN_PLACE in out.kinds()   # its executor adopts the record: agreed already
    assert "generation 3.1 names this node already: adopting it" in out.reason
    out = decide(warm(now=T + 21, generation_record=taken, progress_event="reformed", step=80,
                      generation=taken.id, world=WorldView("a", taken.id, 1, 1, 2)), out.memory, FULL)
    (journal,) = [a for a in out.actions if a.kind is Kind.JOURNAL]
    assert journal["event"] == "joined-in-place" and journal["fields"]["replaced"] == ["c"]
    (metric,) = [a for a in out.actions if a.kind is Kind.OBSERVE and a["metric"] == "join_seconds"]
    assert metric["label"] == "spare"
    assert "as a spare in place of c" in out.reason


def test_a_spare_whose_round_the_job_left_falls_back_to_an_ordinary_round():
    m = decide(warm(now=T + 3), started(FULL), FULL).memory
    _fell_back(decide(warm(now=T + 30, round=4), m, FULL))


def test_a_loss_takes_the_warm_spares_into_its_generation():
    mem = Memory.of(Phase.RUNNING).but(step_at=T - 1)
    spare = newcomer("s", True)
    snap_ = snap(node_id="b", peers={"c": C, "s": spare, "t": newcomer("t", True)},
                 generation=G, agent_pid=AGENT)
    _, actions, said = plan_shrink(snap_, mem, [Death(replace(C), "crashed")])
    (shrink_,) = actions
    assert shrink_["spares"] == (("s", 1),)   # one lost, one spare: the world keeps its size
    assert "with the spare(s) s" in said


def test_a_peers_loss_kills_or_restarts_no_newcomer_worker():
    """The spare's daemon votes on a member's crash like any peer, but its workers are in
    no world: no plan to re-form them, no kill of 'the old world' (seen: it killed its
    workers 2 s after they had entered the loss's generation as the spare)."""
    m = decide(warm(now=T + 3), started(FULL), FULL).memory
    m = m.but(dead={"c": Death(C, "crashed")}, evict_at=T)
    out = decide(warm(now=T + 4), m, FULL)
    assert Kind.EVICT in out.kinds() and Kind.SHRINK not in out.kinds()
    assert "restarting the local workers" not in out.reason
    evicted = decide(warm(now=T + 4.1, eviction=Eviction(("c",), True, True)), out.memory, FULL)
    assert evicted.memory.peer.kill_at is None and Kind.KILL_WORKERS not in evicted.kinds()
