"""Scenario files and seeded draws: what is accepted, what is refused and how it is named."""

from __future__ import annotations

import json

import pytest

from elasticd.lab.chaos.faults import INJECTORS, default_kinds
from elasticd.lab.chaos.scenario import (
    FAULT_STEPS,
    PHASES,
    FaultSpec,
    ScenarioError,
    draw,
    from_dict,
    load,
)

TOML = """
seed = 7
nodes = 3
final_step = 400
[[fault]]
kind = "node-kill"
at_step = 100
target = "rank0"
[[fault]]
kind = "etcd-restart"
at_s = 30
"""


def test_a_toml_file_is_read(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text(TOML)
    sc = load(path)
    assert sc.seed == 7 and sc.nodes == 3 and sc.final_step == 400 and sc.name == "s"
    assert sc.faults == (FaultSpec("node-kill", "rank0", 100), FaultSpec("etcd-restart", "any", None, 30.0))
    assert sc.node_names() == ["a", "b", "c"]


def test_a_json_file_round_trips(tmp_path):
    sc = draw(3, default_kinds())
    path = tmp_path / "s.json"
    path.write_text(json.dumps(sc.to_dict()))
    assert load(path) == sc


def test_a_scenario_names_the_daemons_rendezvous_layout(tmp_path):
    assert draw(3, default_kinds()).rounds == "keyed"
    shared = draw(3, default_kinds(), rounds="torch")
    path = tmp_path / "k.json"
    path.write_text(json.dumps(shared.to_dict()))
    assert load(path).rounds == "torch" and load(path) == shared


@pytest.mark.parametrize(("fault", "message"), [
    ({"kind": "meteor", "at_step": 5}, "kind 'meteor' is not one of"),
    ({"kind": "drain"}, "exactly one of at_step"),
    ({"kind": "drain", "at_step": 5, "at_s": 2}, "exactly one of at_step"),
    ({"kind": "drain", "at_step": 0}, "at_step = 0"),
    ({"kind": "drain", "at_s": -1}, "at_s = -1"),
    ({"kind": "drain", "at_step": 5, "target": "z"}, "target 'z'"),
    ({"kind": "drain", "at_step": 5, "when": 1}, "unknown key(s) ['when']"),
    ({"kind": "drain", "at_step": 999}, "is not before final_step 400"),
    ("drain", "a table with kind"),
    ({"kind": "drain", "during": "reform", "at_step": 5}, "exactly one of at_step"),
    ({"kind": "drain", "during": "lunch"}, "during = 'lunch' is not one of inject, drain"),
    ({"kind": "drain", "during": "reform", "gap_s": 31}, "gap_s = 31: seconds in 0..30"),
    ({"kind": "drain", "during": "reform", "gap_s": True}, "gap_s = True"),
    ({"kind": "drain", "at_step": 5, "gap_s": 1}, "gap_s goes with during"),
])
def test_a_bad_fault_is_refused_with_its_number_and_the_fix(fault, message):
    with pytest.raises(ScenarioError, match="fault #2") as info:
        from_dict({"final_step": 400, "fault": [{"kind": "drain", "at_step": 1}, fault]})
    assert message in str(info.value)


@pytest.mark.parametrize(("raw", "message"), [
    ({"fault": []}, "no faults"),
    ({"nodes": 1, "fault": [{"kind": "drain", "at_step": 1}]}, "nodes = 1"),
    ({"etcd_members": 2, "fault": [{"kind": "drain", "at_step": 1}]}, "etcd_members = 2: 1 or 3"),
    ({"etcd_members": 1, "fault": [{"kind": "etcd-quorum-loss", "at_step": 1}]},
     "etcd-quorum-loss needs a 3-member"),
    ({"step_sleep": "slow", "fault": [{"kind": "drain", "at_step": 1}]}, "step_sleep"),
    ({"colour": 1, "fault": [{"kind": "drain", "at_step": 1}]}, "unknown key(s) ['colour']"),
    ({"rounds": "fast", "fault": [{"kind": "drain", "at_step": 1}]}, "rounds = 'fast': one of keyed, torch"),
])
def test_bad_settings_are_refused(raw, message):
    with pytest.raises(ScenarioError) as info:
        from_dict(raw)
    assert message in str(info.value)


def test_a_file_that_does_not_parse_names_itself(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("seed = [")
    with pytest.raises(ScenarioError, match="bad.toml: not valid TOML"):
        load(path)


def test_a_draw_is_a_function_of_the_seed_and_the_set_of_kinds():
    kinds = ["drain", "node-kill", "etcd-restart"]
    one = draw(11, kinds)
    assert one == draw(11, list(reversed(kinds)))
    assert sorted(f.kind for f in one.faults) == sorted(kinds)
    assert [f.at_step for f in one.faults] == [60, 120, 180]
    # The job has FAULT_STEPS per fault: it steps on while each fault recovers.
    assert one.final_step == 60 + 3 * FAULT_STEPS + 150
    assert draw(11, kinds, spacing=400).final_step == 60 + 3 * 400 + 150
    assert draw(11, kinds, final_step=999).final_step == 999
    assert any(draw(s, kinds).faults != one.faults for s in range(12, 20))


def test_a_draw_refuses_unknown_kinds():
    with pytest.raises(ScenarioError, match="unknown fault kind"):
        draw(1, ["node-kill", "meteor"])


def test_a_leader_or_quorum_fault_gets_three_etcd_members_by_default():
    assert from_dict({"fault": [{"kind": "drain", "at_step": 1}]}).etcd_members == 1
    sc = from_dict({"fault": [{"kind": "drain", "at_step": 1}, {"kind": "etcd-leader-kill", "at_step": 2}]})
    assert sc.etcd_members == 3
    assert draw(1, default_kinds()).etcd_members == 3


def test_network_faults_do_not_mix_with_what_needs_loopback():
    net = {"kind": "partition-etcd", "at_step": 10}
    for other, named in (({"kind": "etcd-leader-kill", "at_step": 20}, "etcd_members = 3"),
                         ({"kind": "preemption-notice", "at_step": 20}, "preemption-notice")):
        with pytest.raises(ScenarioError, match=f"partition-etcd runs the cluster on a network "
                                                f"of its own.*{named} needs loopback"):
            from_dict({"faults": [net, other], "final_step": 100})
    assert from_dict({"faults": [net], "final_step": 100}).etcd_members == 1


def test_a_fault_may_overlap_a_phase_of_the_previous_ones_recovery(tmp_path):
    path = tmp_path / "o.toml"
    path.write_text(TOML.replace('at_s = 30', 'during = "reform"\ngap_s = 0.8'))
    sc = load(path)
    assert sc.faults[1] == FaultSpec("etcd-restart", "any", during="reform", gap_s=0.8)
    assert sc.faults[1].when() == "0.8 s into the previous fault's reform"
    again = tmp_path / "o.json"
    again.write_text(json.dumps(sc.to_dict()))
    assert load(again) == sc


def test_the_first_fault_cannot_overlap_anything():
    with pytest.raises(ScenarioError, match="fault #1: during names a phase of the previous"):
        from_dict({"fault": [{"kind": "drain", "during": "inject"}]})


def test_an_overlapping_draw_pairs_faults_in_phases_their_injectors_go_through():
    kinds = ["drain", "node-kill", "node-stop", "etcd-restart", "worker-kill"]
    sc = draw(5, kinds, overlap=True)
    assert sc == draw(5, kinds, overlap=True) and sc.name == "seed-5-overlap"
    plain = draw(5, kinds)
    # The same kinds, order and targets as the plain draw: only the timing differs.
    assert [(f.kind, f.target) for f in sc.faults] == [(f.kind, f.target) for f in plain.faults]
    for i, (before, f) in enumerate(zip(sc.faults, sc.faults[1:], strict=False), start=1):
        if i % 2:
            assert f.at_step is None and f.during in INJECTORS[before.kind].phases
            assert 0 <= f.gap_s <= 2
        else:
            assert f.during is None and f.at_step == plain.faults[i].at_step
    assert sc.faults[0].during is None
    assert sc.final_step == 60 + 3 * FAULT_STEPS + 150   # 3 bursts of 5 faults
    drawn = {f.during for s in range(40) for f in draw(s, kinds, overlap=True).faults if f.during}
    assert len(drawn) >= 4 and drawn <= set(PHASES)


def test_every_injectors_phases_are_known():
    assert all(cls.phases and set(cls.phases) <= set(PHASES) for cls in INJECTORS.values())


def test_a_fault_that_lasts_may_say_how_long_and_the_others_may_not():
    cut = {"kind": "partition-peers", "during": "reform", "for_s": 25}
    sc = from_dict({"final_step": 400, "etcd_members": 1,
                    "fault": [{"kind": "node-stop", "at_step": 5, "for_s": 40}, cut]})
    assert [f.for_s for f in sc.faults] == [40.0, 25.0]
    assert INJECTORS["node-stop"](40.0).lasting(8.0) == 40.0 and INJECTORS["node-stop"]().lasting(8.0) == 8.0
    for fault, message in (({"kind": "drain", "at_step": 5, "for_s": 10}, "drain does not last"),
                           ({"kind": "node-stop", "at_step": 5, "for_s": 0}, "for_s = 0: seconds in 1..600")):
        with pytest.raises(ScenarioError, match="fault #1: " + message):
            from_dict({"fault": [fault]})


def test_supervisor_settings_are_checked_as_the_daemon_checks_them():
    sc = from_dict({"fault": [{"kind": "drain", "at_step": 5}],
                    "supervisor": {"hang_timeout_s": 15, "broken_round_grace_s": 3600}})
    assert sc.supervisor == {"hang_timeout_s": 15, "broken_round_grace_s": 3600}
    assert from_dict(sc.to_dict()) == sc
    for bad, message in (({"hang_timeout_s": -1}, "supervisor.hang_timeout_s = -1 is not valid"),
                         ({"colour": 1}, r"unknown key\(s\) \['colour'\]"),
                         ({"drain_grace_s": 5}, "set by the harness"),
                         ("fast", "a table of")):
        with pytest.raises(ScenarioError, match=message):
            from_dict({"fault": [{"kind": "drain", "at_step": 5}], "supervisor": bad})
