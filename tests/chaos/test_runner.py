"""The runner's decisions without processes: which node a fault hits, when a recovery
counts as stable, the job it runs."""

from __future__ import annotations

import random
import time

import pytest

from elasticd.chaos.faults import INJECTORS, InjectionError, Target
from elasticd.chaos.run import entrypoint, wait_stable
from elasticd.chaos.scenario import FaultSpec, Scenario, draw


class FakeNode:
    """What the runner reads of a node: its name, whether it runs, its progress file."""

    def __init__(self, name: str, rank: int, world: int = 3, up: bool = True) -> None:
        self.name, self.rank, self.world, self.up = name, rank, world, up
        self.stale_until = 0.0

    def running(self) -> bool:
        return self.up

    def progress(self) -> dict:
        now = time.time()
        stamp = now - 5 if now < self.stale_until else now
        return {"rank": self.rank, "world_size": self.world, "time": stamp, "step": 10}


def _target(*nodes: FakeNode) -> Target:
    return Target({n.name: n for n in nodes}, None, None)


def test_targets_resolve_to_the_rank0_node_another_node_a_named_one_or_none():
    a, b, c = FakeNode("a", 1), FakeNode("b", 0), FakeNode("c", 2)
    t, rng = _target(a, b, c), random.Random(1)
    from elasticd.chaos.run import resolve_target

    def hit(kind: str, target: str):
        return resolve_target(FaultSpec(kind, target, 1), INJECTORS[kind](), t, rng)

    assert hit("node-kill", "rank0") is b
    assert all(hit("node-kill", "other") is not b for _ in range(20))
    assert hit("node-kill", "c") is c
    assert hit("rank0-node-kill", "a") is b          # the injector fixes its own target
    assert hit("etcd-restart", "a") is None          # a cluster-wide fault hits no node
    c.up = False
    with pytest.raises(InjectionError, match="no such running node"):
        hit("node-kill", "c")


def test_a_recovery_counts_once_the_world_was_whole_for_the_settle_time():
    nodes = [FakeNode("a", 0), FakeNode("b", 1)]
    t0 = time.time()
    got = wait_stable(nodes, 3, t0 - 1, timeout_s=5, settle_s=0.5)
    assert got is not None and got - t0 < 0.5


def test_a_break_in_the_steps_restarts_the_settle_clock():
    nodes = [FakeNode("a", 0), FakeNode("b", 1)]
    nodes[1].stale_until = time.time() + 0.6   # b paused (a restart) for 0.6 s
    t0 = time.time()
    got = wait_stable(nodes, 3, t0 - 1, timeout_s=5, settle_s=0.4)
    assert got is not None and got >= t0 + 0.55


def test_a_world_that_never_comes_back_is_none():
    nodes = [FakeNode("a", 0, world=2), FakeNode("b", 1, world=2)]
    assert wait_stable(nodes, 3, 0, timeout_s=0.5, settle_s=0.2) is None


def test_the_job_is_the_float64_mlp_with_every_step_logged_to_the_final_step():
    sc = Scenario(1, (FaultSpec("drain", "any", 5),), nodes=3, final_step=123)
    cmd = entrypoint(sc)
    assert "--dtype=float64" in cmd and "--log-every=1" in cmd and "--max-steps=123" in cmd
    assert "--lr-base-world-size=3" in cmd


def test_the_default_draw_leaves_out_what_needs_a_mounted_filesystem_or_its_own_network():
    from elasticd.chaos.faults import default_kinds

    network = {name for name, cls in INJECTORS.items() if cls.network}
    assert network >= {"partition-etcd", "partition-peers", "netem"}
    assert set(INJECTORS) - set(default_kinds()) == {"checkpoint-dir-full", *network}


def test_every_injector_is_drawable_and_named_once():
    from tests.chaos.test_chaos import sequence_kinds

    for network in (False, True):
        sc = draw(0, sequence_kinds(network))
        assert sorted(f.kind for f in sc.faults) == sequence_kinds(network)
    assert sorted([*sequence_kinds(False), *sequence_kinds(True), "checkpoint-dir-full"]) == sorted(INJECTORS)
    assert all(cls.name == name and cls.summary for name, cls in INJECTORS.items())


def test_the_command_line_lists_the_faults_and_refuses_a_bad_scenario(tmp_path, capsys):
    from elasticd.chaos.__main__ import main

    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in INJECTORS)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[fault]]\nkind = "meteor"\nat_step = 3\n')
    assert main(["--scenario", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "kind 'meteor' is not one of" in capsys.readouterr().err
    assert main(["--seed", "1", "--faults", "node-kill,meteor"]) == 2
