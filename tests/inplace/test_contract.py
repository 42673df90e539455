"""The in-place loss contract, run against both paths that decide a loss.

As torch runs ``RendezvousBackendTestMixin`` against every rendezvous backend, one suite
of scenarios (``LossContract``) runs against each in-place path's real decision code:

* ``TestDaemonPath``: the daemon's policy (``supervisor.decide``, cycle after cycle); its
  verdict is the ``lost`` of the first SHRINK it asks for;
* ``TestCompanionPath``: plain torchrun's companion (``companion.plan``, which runs
  ``judge``, tick after tick); its verdict is the loss of the first SHRINK it asks for.

A scenario is what node ``a`` observes, tick by tick: whose record lives and whom that
record suspects, and what a's own probes answered. The adapters translate that into each
path's inputs; nothing else about the paths is faked. Both must reach the same verdict
(lost nodes and cause) or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from elasticd.actions import Kind
from elasticd.contract.generation import GenerationId, GenerationRecord, WorldView, renumber
from elasticd.contract.settings import IN_PLACE
from elasticd.inplace.loss import Loss
from elasticd.probe import Liveness
from elasticd.rendezvous.companion import Judgement, PeerRecord, Seen, plan
from elasticd.supervisor import Memory, PeerView, Phase, Policy, Snapshot, decide

ME = "a"
G = GenerationId(3, 0, "ep")
T0 = 1000.0
SILENT_SUSPECT_S = 5.0


@dataclass(frozen=True)
class Tick:
    """One observation by node a: ``records``: the members whose record lives, each with
    the peers its record suspects; ``answers``: a's probes (node -> alive | refused |
    silent), of live members and of those whose record vanished."""

    at: float
    records: dict[str, str]
    answers: dict[str, str] = field(default_factory=dict)


def _all(suspects: dict[str, str] | None = None, nodes: str = "abc") -> dict[str, str]:
    return {n: (suspects or {}).get(n, "") for n in nodes}


class LossContract:
    """Every path that decides an in-place loss reaches these verdicts."""

    world = ("a", "b", "c")

    def verdict(self, ticks: list[Tick], world: tuple[str, ...]) -> Loss | None:
        raise NotImplementedError

    def test_a_crash_every_survivor_sees_is_a_loss(self):
        ticks = [Tick(T0, _all({"b": "c"}), {"b": "alive", "c": "refused"})]
        assert self.verdict(ticks, self.world) == Loss(("c",), "peer-crashed")

    def test_one_refused_probe_alone_is_no_loss_while_the_record_lives(self):
        ticks = [Tick(T0, _all(), {"b": "alive", "c": "refused"}),
                 Tick(T0 + 0.2, _all(), {"b": "alive", "c": "refused"})]
        assert self.verdict(ticks, self.world) is None

    def test_a_node_behind_a_reject_cut_fences_nobody_out(self):
        cut = {"b": "refused", "c": "refused"}
        ticks = [Tick(T0, _all({"b": "a", "c": "a"}), cut),
                 Tick(T0 + 0.2, _all({"b": "a", "c": "a"}), cut)]
        assert self.verdict(ticks, self.world) is None

    def test_a_frozen_peer_whose_lease_expired_is_a_silent_loss(self):
        ticks = [Tick(T0, _all(), {"b": "alive", "c": "silent"}),
                 Tick(T0 + 1, _all(nodes="ab"), {"b": "alive", "c": "silent"}),
                 Tick(T0 + 1.1, _all(nodes="ab"), {"b": "alive", "c": "silent"})]
        assert self.verdict(ticks, self.world) == Loss(("c",), "peer-silent")

    def test_a_vanished_record_whose_peer_refuses_is_a_crash(self):
        ticks = [Tick(T0, _all(), {"b": "alive", "c": "alive"}),
                 Tick(T0 + 1, _all(nodes="ab"), {"b": "alive", "c": "refused"}),
                 Tick(T0 + 1.1, _all(nodes="ab"), {"b": "alive", "c": "refused"})]
        assert self.verdict(ticks, self.world) == Loss(("c",), "peer-crashed")

    def test_a_vanished_record_whose_peer_answers_moved_on_and_is_no_loss(self):
        ticks = [Tick(T0, _all(), {"b": "alive", "c": "alive"}),
                 Tick(T0 + 1, _all(nodes="ab"), {"b": "alive", "c": "alive"}),
                 Tick(T0 + 1.1, _all(nodes="ab"), {"b": "alive", "c": "alive"})]
        assert self.verdict(ticks, self.world) is None

    def test_a_silence_the_majority_shares_is_a_loss_after_the_bound_only(self):
        early = [Tick(T0, _all({"b": "c"}), {"b": "alive", "c": "silent"}),
                 Tick(T0 + 1, _all({"b": "c"}), {"b": "alive", "c": "silent"})]
        assert self.verdict(early, self.world) is None
        late = [*early, Tick(T0 + SILENT_SUSPECT_S, _all({"b": "c"}), {"b": "alive", "c": "silent"})]
        assert self.verdict(late, self.world) == Loss(("c",), "peer-silent")

    def test_in_a_world_of_two_the_lease_decides(self):
        ticks = [Tick(T0, _all(nodes="ab"), {"b": "refused"}),
                 Tick(T0 + 0.2, _all(nodes="ab"), {"b": "refused"})]
        assert self.verdict(ticks, ("a", "b")) is None
        gone = [*ticks, Tick(T0 + 2, {"a": ""}, {"b": "refused"}),
                Tick(T0 + 2.1, {"a": ""}, {"b": "refused"})]
        assert self.verdict(gone, ("a", "b")) == Loss(("b",), "peer-crashed")

    def test_a_peer_outside_our_workers_world_is_no_loss(self):
        ticks = [Tick(T0, _all({"b": "c"}), {"b": "alive", "c": "refused"})]
        assert self.verdict(ticks, ("a", "b")) is None


# -- the daemon's policy ---------------------------------------------------------------------

POLICY = Policy(recovery_mode=IN_PLACE, confirm_timeout_s=1.5, silent_suspect_s=SILENT_SUSPECT_S)


def _view(node: str, suspects: str, world: tuple[str, ...]) -> PeerView:
    rank = world.index(node) if node in world else 0
    return PeerView(node, "running", (f"127.0.0.{rank + 1}", 100 + rank), 1,
                    f"127.0.0.{rank + 1}:9", WorldView(node, G, rank, 1, len(world)),
                    suspects=frozenset(suspects))


class TestDaemonPath(LossContract):
    def verdict(self, ticks: list[Tick], world: tuple[str, ...]) -> Loss | None:
        mine = WorldView(ME, G, world.index(ME), 1, len(world))
        mem = Memory.of(phase=Phase.RUNNING, workers=frozenset({11}), agent_pid=42,
                     step_at=T0 - 0.5, peers_seen=frozenset(n for n in world if n != ME))
        seen: dict[str, PeerView] = {n: _view(n, "", world) for n in world if n != ME}
        for tick in ticks:
            peers = {n: _view(n, s, world) for n, s in tick.records.items() if n != ME}
            departed = tuple(seen[n] for n in seen if n not in peers)
            # A vanished peer's confirmation is the daemon's next cycle: its probe answer.
            asked = {n: tick.answers[n] for n in seen if n not in peers and n in tick.answers}
            snap = Snapshot(now=tick.at, agent_pid=42, workers=frozenset({11}), step=5,
                            node_id=ME, peers=peers, generation=G, world=mine,
                            probe_answers={n: a for n, a in tick.answers.items() if n in peers},
                            departed=departed, confirmations=asked)
            out = decide(snap, mem, POLICY)
            mem, seen = out.memory, peers   # membership reports a departure once
            # The daemon's second cycle on the same observation: a departed peer's
            # confirmation (CONFIRM_PEER's answer) arrives.
            if departed and not _shrinks(out):
                out = decide(replace(snap, now=tick.at + 0.01, departed=()), mem, POLICY)
                mem = out.memory
            lost = _shrinks(out)
            if lost is not None:
                # The daemon asks for every dead member; the agreement leaves out those
                # not in the workers' world (``unneeded``): the verdict is the rest.
                inside = tuple(n for n in lost[0] if n in world)
                return Loss(inside, lost[1]) if inside else None
        return None


def _shrinks(out) -> tuple[tuple[str, ...], str] | None:
    shrink = [a for a in out.actions if a.kind is Kind.SHRINK]
    return (shrink[0]["lost"], shrink[0]["cause"]) if shrink else None


# -- the plain-torchrun companion --------------------------------------------------------------

def _record(node: str, suspects: str, world: tuple[str, ...]) -> PeerRecord:
    rank = world.index(node) if node in world else 0
    return PeerRecord(node, f"127.0.0.{rank + 1}:9", f"127.0.0.{rank + 1}:8",
                      WorldView(node, G, rank, 1, len(world)), suspects=frozenset(suspects))


class TestCompanionPath(LossContract):
    """The companion's decision as its loop takes it: ``plan`` over one snapshot a tick
    (the verdicts of ``judge``, then the actions), the loss being its SHRINK action's."""

    def verdict(self, ticks: list[Tick], world: tuple[str, ...]) -> Loss | None:
        # The workers' generation names the world (what the companion last handed over).
        adopted = GenerationRecord(G, renumber([(n, 1) for n in world]), "127.0.0.1:8")
        mine = _record(ME, "", world)
        known: dict[str, PeerRecord] = {}
        judgement, published = Judgement(), mine
        for tick in ticks:
            known.update({n: _record(n, s, world) for n, s in tick.records.items()})
            seen = Seen(reported=G, finished=False, completed=False, world=mine.world,
                        known=dict(known), present=frozenset(tick.records),
                        answers={n: Liveness(a) for n, a in tick.answers.items()},
                        agreed=None, now=tick.at)
            step = plan(ME, seen, mine, published, adopted, judgement, SILENT_SUSPECT_S)
            judgement, mine, published = step.judgement, step.mine, step.mine
            shrink = [a for a in step.actions if a.kind is Kind.SHRINK]
            if shrink:
                return shrink[0]["loss"]
        return None
