"""The plain-torchrun recovery companion's decisions, without processes, and its
``--rdzv-conf recovery=`` key."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import replace

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.actions import Kind
from elasticd.contract.generation import GenerationId, GenerationRecord, WorldView, renumber
from elasticd.errors import ConfigError
from elasticd.inplace.loss import Loss
from elasticd.probe import Liveness
from elasticd.rendezvous.companion import (
    Judgement,
    PeerRecord,
    RecoveryCompanion,
    Seen,
    judge,
    plan,
    probe_targets,
    remove_stale_dirs,
    workers_generation,
)
from elasticd.rendezvous.handler import parse_params

GEN = GenerationId(4, 0, "e")
T = 100.0


def _known(*nodes: str, done: tuple[str, ...] = ()) -> dict[str, PeerRecord]:
    return {n: PeerRecord(n, f"127.0.0.1:{1000 + i}", f"127.0.0.1:{2000 + i}",
                          WorldView(n, GEN, i, 1, len(nodes)), n in done)
            for i, n in enumerate(nodes)}


def _judge(me, known, present, answers, world=None, finished=False, prior=None, now=T,
           silent_s=5.0):
    return judge(me, known, present, answers, world, finished, prior or Judgement(), now, silent_s)


def _suspecting(known: dict[str, PeerRecord], **suspects: str) -> dict[str, PeerRecord]:
    """``known`` with each named member's record suspecting the given peers."""
    return {n: replace(r, suspects=frozenset(suspects.get(n, ""))) for n, r in known.items()}


def test_a_refused_probe_is_a_suspicion_and_a_crash_once_a_majority_suspects():
    known = _known("a", "b", "c")
    alone = _judge("a", known, {"a", "b", "c"}, {"b": Liveness.REFUSED, "c": Liveness.ALIVE})
    assert alone.suspicions == {"b": ("crashed", T)} and alone.loss is None
    assert alone.condemned == frozenset()
    # c suspects b too: 2 of 3 live members, condemned.
    both = _judge("a", _suspecting(known, c="b"), {"a", "b", "c"},
                  {"b": Liveness.REFUSED, "c": Liveness.ALIVE})
    assert both.condemned == {"b"} and both.loss == Loss(("b",), "peer-crashed")


def test_a_companion_cut_off_from_the_majority_condemns_nobody():
    """Behind a REJECT cut every probe is refused: a minority's votes fence nobody out."""
    known = _suspecting(_known("a", "b", "c"), b="a", c="a")
    cut = _judge("a", known, {"a", "b", "c"}, {"b": Liveness.REFUSED, "c": Liveness.REFUSED})
    assert cut.isolated and cut.condemned == frozenset() and cut.loss is None


def test_in_a_world_of_two_one_vote_is_no_majority():
    known = _known("a", "b")
    out = _judge("a", known, {"a", "b"}, {"b": Liveness.REFUSED})
    assert out.loss is None, "the lease's expiry (etcd's majority) decides a world of two"
    gone = _judge("a", known, {"a"}, {"b": Liveness.REFUSED}, prior=out)
    assert gone.loss == Loss(("b",), "peer-crashed")


def test_a_silence_is_a_suspicion_after_the_bound():
    known = _suspecting(_known("a", "b", "c"), b="c")
    first = _judge("a", known, {"a", "b", "c"}, {"c": Liveness.SILENT})
    assert first.suspicions == {} and first.silent_since == {"c": T} and first.loss is None
    later = _judge("a", known, {"a", "b", "c"}, {"c": Liveness.SILENT}, prior=first, now=T + 5)
    assert later.loss == Loss(("c",), "peer-silent")


def test_a_vanished_record_whose_agent_does_not_answer_is_a_silent_peer():
    known = _known("a", "b", "c")
    assert _judge("a", known, {"a", "b"}, {"c": Liveness.SILENT}).loss == Loss(
        ("c",), "peer-silent")
    # Not probed yet: no verdict.
    assert _judge("a", known, {"a", "b"}, {}).loss is None


def test_a_vanished_record_whose_agent_answers_has_moved_on_to_a_restart():
    known = _known("a", "b", "c")
    assert _judge("a", known, {"a", "b"}, {"c": Liveness.ALIVE}).loss is None


def test_slow_is_not_dead_while_the_record_lives():
    known = _known("a", "b", "c")
    assert _judge("a", known, {"a", "b", "c"}, {"c": Liveness.SILENT}).loss is None


def test_completed_peers_finished_workers_and_former_members_are_never_lost():
    known = _known("a", "b", "c", done=("b",))
    refused = {"b": Liveness.REFUSED, "c": Liveness.REFUSED}
    assert _judge("a", known, {"a"}, refused).loss == Loss(("c",), "peer-crashed")
    assert _judge("a", known, {"a"}, refused, finished=True).loss is None
    assert _judge("a", known, {"a"}, refused, world=("a", "b")).loss is None
    assert _judge("c", known, {"a"}, refused).loss is None  # never itself


def test_two_losses_at_once_are_one_shrink_and_silence_names_the_cause():
    known = _known("a", "b", "c", "d")
    out = _judge("a", known, {"a", "c"}, {"b": Liveness.REFUSED, "d": Liveness.SILENT})
    assert out.loss == Loss(("b", "d"), "peer-silent")


def test_probe_targets_are_ring_successors_the_suspected_and_every_vanished_member():
    known = ["a", "b", "c", "d", "e"]
    assert probe_targets("a", known, known, neighbours=2) == ["b", "c"]
    assert probe_targets("d", known, known, neighbours=2) == ["a", "e"]
    assert probe_targets("a", known, ["a", "b", "c", "e"], neighbours=2) == ["b", "c", "d"]
    assert probe_targets("a", known, known, suspected={"e", "a"}, neighbours=2) == ["b", "c", "e"]
    assert probe_targets("a", ["a"], ["a"]) == []


def _seen(known, present, answers, *, world=None, agreed=None, completed=False, now=T):
    return Seen(reported=GEN, finished=completed, completed=completed, world=world,
                known=known, present=frozenset(present), answers=answers, agreed=agreed,
                now=now)


def test_plan_publishes_only_a_changed_record_and_shrinks_a_loss():
    known = _known("a", "b", "c")
    mine = known["a"]
    quiet = plan("a", _seen(known, known, {}), mine, mine, None, Judgement(), 5.0)
    assert quiet.actions == () and quiet.mine == mine
    # c crashed (its record went, its probe is refused): the loss is shrunk; nothing of
    # ours changed, so nothing is published.
    out = plan("a", _seen(known, {"a", "b"}, {"c": Liveness.REFUSED}), mine, mine, None,
               Judgement(), 5.0)
    assert [a.kind for a in out.actions] == [Kind.SHRINK]
    assert out.actions[0]["loss"] == Loss(("c",), "peer-crashed")
    assert out.actions[0]["reported"] == GEN
    # our workers completed: the record says so (our departure is no loss), and no shrink
    done = plan("a", _seen(known, {"a", "b"}, {"c": Liveness.REFUSED}, completed=True), mine,
                mine, None, Judgement(), 5.0)
    assert [a.kind for a in done.actions] == [Kind.PUBLISH] and done.mine.done
    assert done.actions[0]["record"] == done.mine


def test_plan_publishes_suspicions_and_evicts_only_on_the_majoritys_verdict():
    known = _known("a", "b", "c")
    mine = known["a"]
    alone = plan("a", _seen(known, known, {"b": Liveness.REFUSED}), mine, mine, None,
                 Judgement(), 5.0)
    assert [a.kind for a in alone.actions] == [Kind.PUBLISH]
    assert alone.mine.suspects == {"b"}
    backed = _suspecting(known, c="b")
    both = plan("a", _seen(backed, backed, {"b": Liveness.REFUSED}), alone.mine, alone.mine,
                None, alone.judgement, 5.0)
    kinds = [a.kind for a in both.actions]
    assert kinds[:1] == [Kind.EVICT] and both.actions[0]["peers"] == ("b",)
    assert kinds[1:] == [Kind.SHRINK] and both.actions[1]["loss"].lost == ("b",)


def test_plan_hands_over_a_newer_record_another_survivor_agreed_and_judges_past_it():
    known = _known("a", "b", "c")
    mine = known["a"]
    agreed = GenerationRecord(GEN.next(), renumber([("a", 1), ("b", 1)]), mine.store,
                              lost=("c",), cause="peer-crashed")
    out = plan("a", _seen(known, {"a", "b"}, {"c": Liveness.REFUSED}, agreed=agreed), mine,
               mine, None, Judgement(), 5.0)
    # c is settled by that record: handed to our workers, not shrunk a second time
    assert [a.kind for a in out.actions] == [Kind.WRITE_GENERATION]
    assert out.actions[0]["record"] == agreed
    # an older or equal record is not handed over again
    again = plan("a", _seen(known, {"a", "b"}, {}, agreed=agreed), mine, mine, agreed,
                 Judgement(), 5.0)
    assert again.actions == ()


def test_plan_hands_over_no_record_the_rounds_records_do_not_bear_out():
    # Issue 27 finding 1: a record naming a foreign member, or a store that rank 0's
    # companion does not publish, is never handed to the workers (nor shrinks judged past).
    known = _known("a", "b", "c")
    mine = known["a"]
    forged = [GenerationRecord(GEN.next(), renumber([("a", 1), ("mallory", 1)]), mine.store,
                               lost=("b", "c")),
              GenerationRecord(GEN.next(), renumber([("a", 1), ("b", 1)]), "10.6.6.6:29500",
                               lost=("c",))]
    for agreed in forged:
        out = plan("a", _seen(known, {"a", "b", "c"}, {}, agreed=agreed), mine, mine, None,
                   Judgement(), 5.0)
        assert Kind.WRITE_GENERATION not in [a.kind for a in out.actions], agreed


def test_workers_generation_is_the_newer_of_reported_and_handed_over():
    rec = GenerationRecord(GEN.next(), renumber([("a", 1), ("b", 1)]), "127.0.0.1:1")
    assert workers_generation(None, None) is None
    assert workers_generation(GEN, None) == GEN
    assert workers_generation(GEN, rec) == GEN.next()
    assert workers_generation(None, rec) == GEN.next()
    assert workers_generation(GenerationId(4, 2, "e"), rec) == GenerationId(4, 2, "e")


def test_record_round_trip_and_malformed_records_are_ignored():
    rec = _known("a", "b")["b"]
    assert PeerRecord.decode("b", rec.encode()) == rec
    bare = PeerRecord("x", "h:1")
    assert PeerRecord.decode("x", bare.encode()) == bare
    for raw in (b"nope", b"[]", b'{"probe": "nohost"}', b'{"probe": "h:1", "store": 5}',
                b'{"probe": "h:1", "done": "yes"}', b'{"probe": "h:1", "world": {"nproc": 0}}',
                b'{"probe": "h:1", "suspects": [1]}', b'{"probe": "h:1", "suspects": "b"}'):
        assert PeerRecord.decode("x", raw) is None, raw


def test_only_the_directories_of_dead_agents_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = tmp_path / f"elasticd-agent-{dead.pid}-x1"
    alive = tmp_path / f"elasticd-agent-{os.getpid()}-x2"
    other = tmp_path / "elasticd-agent-notapid-x3"
    for d in (gone, alive, other):
        d.mkdir()
    (gone / "generation.json").write_text("{}")
    assert remove_stale_dirs(tmp_path) == [gone]
    assert not gone.exists() and alive.exists() and other.exists()


def _params(**conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd3", "127.0.0.1:2379", "job-1", 1, 2, **conf)


def test_recovery_conf_defaults_to_restart_and_takes_in_place():
    assert parse_params(_params()).recovery == "restart"
    assert parse_params(_params(recovery="in-place")).recovery == "in-place"
    assert parse_params(_params(recovery=" In-Place ")).recovery == "in-place"
    assert parse_params(_params(recovery="restart")).recovery == "restart"


def test_a_bad_recovery_value_names_the_choices():
    with pytest.raises(ConfigError, match=r"recovery='inplace'.*restart.*in-place"):
        parse_params(_params(recovery="inplace"))


# -- the executor on a real etcd, in this process (no torchrun) ------------------------------

def _progress(path, rank: int, world: int = 3, seq: int = 0, event: str = "step") -> None:
    path.write_text(json.dumps({"step": 5, "world_size": world, "event": event, "rank": rank,
                                "local_world_size": 1,
                                "generation": {"round": 0, "seq": seq, "epoch": "e"}}))


@pytest.fixture
def three(client, keys, tmp_path, monkeypatch):
    """Companions a, b, c of round 0, each with its workers' progress at world 3."""
    comps: dict[str, RecoveryCompanion] = {}
    for rank, name in enumerate("abc"):
        comp = RecoveryCompanion(client, keys, "127.0.0.1", 2, 0.5).start()
        assert comp.enabled
        _progress(tmp_path / f"{name}.json", rank)
        monkeypatch.setenv("ELASTICD_PROGRESS_FILE", str(tmp_path / f"{name}.json"))
        # on_world writes the workers' settings into os.environ (torchrun copies it): taken
        # back after the test, or later tests in this process read them (the doctor took
        # ELASTICD_NODE_ID for its node id and two of its tests failed in the full suite).
        # (setenv, not delenv: a delenv of an absent variable records nothing to undo.)
        for var in ("ELASTICD_RECOVERY_MODE", "ELASTICD_NODE_ID", "ELASTICD_GENERATION_FILE"):
            monkeypatch.setenv(var, "")
        comp.on_world(0, name)
        assert os.environ["ELASTICD_RECOVERY_MODE"] == "in-place"
        assert os.environ["ELASTICD_NODE_ID"] == name
        assert os.environ["ELASTICD_GENERATION_FILE"] == str(comp.generation_file)
        comps[name] = comp

    def published() -> bool:
        kvs, _ = client.list_prefix(keys.rdzv_recovery(0))
        return len(kvs) == 3 and all(json.loads(kv.value)["world"] for kv in kvs)
    _until(published, 5, "every companion published its world")
    yield comps
    dirs = [c.generation_file.parent for c in comps.values()]
    for comp in comps.values():
        comp.stop(done=False)
    assert not any(d.exists() for d in dirs), "a companion left its directory"


def _until(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out: {what}")
        time.sleep(0.05)


def _dies(comp: RecoveryCompanion) -> None:
    """The agent is gone at once (its threads with it): nothing answers its probe port."""
    comp._round._stop.set()
    comp._lease._stop.set()
    comp._probe.stop()


def _record(comp: RecoveryCompanion) -> GenerationRecord | None:
    try:
        return GenerationRecord.from_json(comp.generation_file.read_bytes())
    except FileNotFoundError:
        return None


@pytest.mark.process
def test_a_crashed_peer_is_agreed_out_in_place_by_both_survivors(three, client, keys):
    a, b, c = three["a"], three["b"], three["c"]
    store_a = json.loads(client.get(keys.rdzv_recovery(0) + "a").value)["store"]
    started = time.monotonic()
    _dies(c)
    _until(lambda: _record(a) and _record(b), 5, "both survivors got the next generation")
    took = time.monotonic() - started
    rec = _record(a)
    assert rec == _record(b)
    assert rec.id == GenerationId(0, 1, "e") and rec.nodes == ("a", "b") and rec.lost == ("c",)
    assert rec.store == store_a and rec.cause == "peer-crashed"
    assert GenerationRecord.from_json(client.get(keys.generation).value) == rec
    # The cause says the refused probe found it (not the lease, which would say silent);
    # the bound is loose for a loaded 2-core machine (0.3-2.1 s measured).
    assert took < 5.0, f"a crash took {took:.2f} s to agree"


@pytest.mark.process
def test_a_silent_peer_is_agreed_out_once_its_lease_expired(three, client, keys):
    a, c = three["a"], three["c"]
    # Frozen, not gone: its port stays open (the kernel accepts connections) but nothing
    # answers, and its lease is no longer kept alive.
    c._round._stop.set()
    c._lease._stop.set()
    c._probe._stop.set()
    time.sleep(1.0)
    assert _record(a) is None, "shrunk while the silent peer's lease still lived"
    _until(lambda: _record(a), 8, "the silent peer agreed out after its lease")
    assert _record(a).cause == "peer-silent" and _record(a).lost == ("c",)


@pytest.mark.process
def test_a_peer_that_moved_on_or_completed_is_no_loss(three, client, keys, tmp_path):
    a, b, c = three["a"], three["b"], three["c"]
    c.leave_round()            # a new rendezvous (torchrun's restart): its record goes, it answers
    _progress(tmp_path / "b.json", 1, event="completed")
    _until(lambda: json.loads(client.get(keys.rdzv_recovery(0) + "b").value)["done"], 3,
           "b published that its workers completed")
    b.stop(done=True)          # its agent exits after success
    time.sleep(2.0)
    assert _record(a) is None and client.get(keys.generation) is None


@pytest.mark.process
def test_a_companion_behind_a_reject_cut_fences_nobody_out(three, client, keys, monkeypatch):
    """Every probe of a's is refused (a firewall that rejects; its etcd link is fine): a
    suspects b and c, but it is a minority of one, so no record is deleted and no
    generation agreed (before the majority rule: a agreed {a} alone in ~0.3 s)."""
    a = three["a"]._round

    def cut_off() -> None:
        a.answers.update({"b": Liveness.REFUSED, "c": Liveness.REFUSED})

    monkeypatch.setattr(a, "_probe_round", cut_off)
    time.sleep(3.0)
    records, _ = client.list_prefix(keys.rdzv_recovery(0))
    assert len(records) == 3 and client.get(keys.generation) is None
    assert _record(three["a"]) is None
