"""The runner's decisions without processes: which node a fault hits, when a recovery
counts as stable, the job it runs."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import pytest

from elasticd.lab.chaos.faults import INJECTORS, InjectionError, Injector, Target
from elasticd.lab.chaos.run import entrypoint, wait_stable
from elasticd.lab.chaos.scenario import FaultSpec, Scenario, draw


class FakeNode:
    """What the runner reads of a node: its name, whether it runs, its progress file."""

    def __init__(self, name: str, rank: int, world: int = 3, up: bool = True) -> None:
        self.name, self.rank, self.world, self.up = name, rank, world, up
        self.stale_until = 0.0

    def running(self) -> bool:
        return self.up

    def tree(self) -> list:
        return []   # no processes: no workers to tell apart

    def progress(self) -> dict:
        now = time.time()
        stamp = now - 5 if now < self.stale_until else now
        return {"rank": self.rank, "world_size": self.world, "time": stamp, "step": 10}


def _target(*nodes: FakeNode) -> Target:
    return Target({n.name: n for n in nodes}, None, None)


def test_targets_resolve_to_the_rank0_node_another_node_a_named_one_or_none():
    a, b, c = FakeNode("a", 1), FakeNode("b", 0), FakeNode("c", 2)
    t, rng = _target(a, b, c), random.Random(1)
    from elasticd.lab.chaos.run import resolve_target

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


@pytest.mark.process
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
    from elasticd.lab.chaos.faults import default_kinds

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
    from elasticd.lab.chaos.__main__ import main

    assert main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in INJECTORS)
    bad = tmp_path / "bad.toml"
    bad.write_text('[[fault]]\nkind = "meteor"\nat_step = 3\n')
    assert main(["--scenario", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "kind 'meteor' is not one of" in capsys.readouterr().err
    assert main(["--seed", "1", "--faults", "node-kill,meteor"]) == 2


# -- overlapping faults: bursts, phases, what a burst's faults may hit -----------------------

def test_faults_written_to_overlap_join_the_burst_of_the_fault_before():
    from elasticd.lab.chaos.run import bursts

    a, b, c, d = (FaultSpec("drain", "any", 5), FaultSpec("node-kill", during="drain"),
                  FaultSpec("node-stop", during="reform", gap_s=1.0), FaultSpec("drain", "any", 50))
    assert bursts([a, b, c, d]) == [(0, [a, b, c]), (3, [d])]
    assert bursts([a, d]) == [(0, [a]), (1, [d])]


class LoggingNode(FakeNode):
    """A fake node with a daemon log the phase watcher tails."""

    def __init__(self, name: str, rank: int, log: Path) -> None:
        super().__init__(name, rank)
        self.log_path = log

    def say(self, event: str, at: float | None = None) -> None:
        stamp = datetime.fromtimestamp(at or time.time(), UTC).isoformat()
        with self.log_path.open("a") as f:
            f.write(json.dumps({"event": event, "timestamp": stamp}) + "\n")


def test_an_overlapping_fault_waits_for_its_phase_after_the_previous_injection_then_the_gap(tmp_path):
    from elasticd.lab.chaos.run import await_phase

    a, b = LoggingNode("a", 0, tmp_path / "a.log"), LoggingNode("b", 1, tmp_path / "b.log")
    since = time.time()
    a.say("peer(s) c lost; evicting them and re-forming the world in place", at=since - 5)  # before
    threading.Timer(0.3, b.say, ["peer(s) c lost; evicting them from the rendezvous and re-forming "
                                 "the world in place"]).start()
    spec = FaultSpec("node-kill", during="reform", gap_s=0.4)
    got = await_phase(spec, since, [a, b], timeout_s=5)["overlap"]
    assert got["phase"] == "reform" and got["phase_node"] == "b"
    # phase_at is recorded to the millisecond (rounded), so the gap is checked to within one
    assert since + 0.25 <= got["phase_at"] and time.time() >= got["phase_at"] + 0.4 - 0.001


def test_a_phase_that_never_begins_lets_the_fault_fire_at_the_timeout_marked_unseen(tmp_path):
    from elasticd.lab.chaos.run import await_phase

    a = LoggingNode("a", 0, tmp_path / "a.log")
    a.say("registered in etcd; watching peers")
    t0 = time.time()
    got = await_phase(FaultSpec("drain", during="drain"), t0 - 1, [a], timeout_s=0.5)["overlap"]
    assert got == {"phase": "drain", "phase_seen": False} and time.time() - t0 >= 0.5
    assert await_phase(FaultSpec("drain", during="inject", gap_s=0.2), t0, [a])["overlap"][
        "phase_at"] == round(t0, 3)


def test_a_burst_never_hits_a_node_an_earlier_fault_of_it_still_holds_down_it_retargets():
    from elasticd.lab.chaos.run import resolve_target

    a, b, c = FakeNode("a", 1), FakeNode("b", 0), FakeNode("c", 2)
    t, rng = _target(a, b, c), random.Random(3)
    busy = frozenset({"a"})
    assert all(resolve_target(FaultSpec("node-kill", "any"), INJECTORS["node-kill"](), t, rng, busy)
               is not a for _ in range(30))
    assert resolve_target(FaultSpec("node-kill", "other"), INJECTORS["node-kill"](), t, rng, busy) is c
    notes: dict = {}
    assert resolve_target(FaultSpec("node-kill", "a"), INJECTORS["node-kill"](), t, rng, busy,
                          notes) in (b, c) and notes == {"retargeted_from": "a"}
    notes = {}
    assert resolve_target(FaultSpec("rank0-node-kill"), INJECTORS["rank0-node-kill"](), t, rng,
                          frozenset({"b"}), notes) in (a, c) and notes == {"retargeted_from": "b"}
    with pytest.raises(InjectionError, match="every running node is down by an earlier fault"):
        resolve_target(FaultSpec("node-kill", "a"), INJECTORS["node-kill"](), t, rng,
                       frozenset({"a", "b", "c"}))


class Marker(Injector):
    """A fault that only notes when it was injected and healed (its hold: 1 s)."""

    name = "test-marker"
    summary = "notes its moments"
    hold_s = 1.0
    replaces_workers = False

    def inject(self, t, victim):
        return {"victim": victim.name}


@pytest.mark.process
def test_a_bursts_faults_fire_while_the_earlier_ones_heal_and_recover_as_one(monkeypatch):
    from elasticd.lab.chaos import run

    monkeypatch.setitem(INJECTORS, "test-marker", Marker)
    monkeypatch.setattr(run, "SETTLE_S", 0.3)
    monkeypatch.setattr(run, "wait_stable", lambda nodes, world, since, timeout_s, **kw: since + 0.1)
    a, b, c = FakeNode("a", 0), FakeNode("b", 1), FakeNode("c", 2)
    specs = [FaultSpec("test-marker", "a", 1), FaultSpec("test-marker", "any", during="inject", gap_s=0.2)]
    first, second = run._burst(0, specs, [a, b, c], _target(a, b, c), random.Random(1), lambda s: None)
    assert first.target == "a" and second.target in ("b", "c")   # a was still held down
    assert first.t_inject + 0.2 <= second.t_inject < first.t_heal          # inside the first's hold
    assert second.detail["overlap"] == {"phase": "inject", "phase_at": round(first.t_inject, 3),
                                        "phase_node": None}
    assert first.t_recovered == second.t_recovered == max(first.t_heal, second.t_heal) + 0.1
    assert first.error is None and second.error is None
    run._RUN_OVER.set()   # the heal threads end


class Spawner(Marker):
    """A heal that starts a process tied to the thread that forks it (as an etcd member's
    restart is: proctree.with_parent_death_signal)."""

    name = "test-spawner"
    hold_s = 0.0

    def heal(self, t, victim):
        from elasticd import proctree

        self.proc = subprocess.Popen(proctree.with_parent_death_signal(["sleep", "60"]))
        return {"pid": self.proc.pid}


def test_what_a_heal_starts_outlives_the_heal_until_the_run_is_over(monkeypatch):
    from elasticd.lab.chaos import run

    monkeypatch.setitem(INJECTORS, "test-spawner", Spawner)
    monkeypatch.setattr(run, "wait_stable", lambda nodes, world, since, timeout_s, **kw: since)
    run._RUN_OVER.clear()
    a = FakeNode("a", 0)
    (rec,) = run._burst(0, [FaultSpec("test-spawner", "a", 1)], [a], _target(a), random.Random(1),
                        lambda s: None)
    proc = psutil.Process(rec.detail["pid"])
    try:
        time.sleep(0.5)
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE   # the heal returned
    finally:
        run._RUN_OVER.set()
    assert proc.wait(timeout=10) == -signal.SIGKILL   # gone with its thread, once the run is over


def test_the_command_line_names_itself_and_writes_reports_under_home_not_here(capsys):
    from elasticd.lab.chaos.__main__ import default_out, parser

    with pytest.raises(SystemExit):
        parser("elasticd chaos").parse_args(["--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: elasticd chaos") and "a short run: elasticd chaos --seed 7" in text
    args = parser().parse_args(["--seed", "7"])
    assert args.out is None and default_out(args) == Path.home() / "elasticd-chaos" / "seed-7"
    args = parser().parse_args(["--scenario", "/x/stop-then-drain.toml"])
    assert default_out(args) == Path.home() / "elasticd-chaos" / "stop-then-drain"
