"""Each fault injector on a live 3-node job (marker chaos, `make chaos`): the fault is
injected, the job recovers and completes, and every invariant holds; plus the evidence
that the injector did bite (the process it killed, what the kill caught, the load that
had to skip the damaged checkpoint).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from elasticd.lab.chaos.cluster_faults import FILLER, EtcdLeaderKill, etcd_cluster
from elasticd.lab.chaos.faults import INJECTORS, default_kinds
from elasticd.lab.chaos.invariants import LEADER_CHANGE_S, check_all, rank0_records
from elasticd.lab.chaos.run import run_scenario
from elasticd.lab.chaos.scenario import FaultSpec, Scenario
from elasticd.lab.local_cluster import Cluster, json_lines, record_time
from tests.chaos.common import run_checked

pytestmark = pytest.mark.chaos


def one_fault(kind: str, target: str = "other", at_step: int = 40, final: int = 700) -> Scenario:
    # 700 steps of 0.1 s: room for a rejoin that takes a minute on a loaded machine (seen:
    # 80 s after a node's SIGKILL), so the job does not end in the smaller world first.
    return Scenario(seed=5, faults=(FaultSpec(kind, target, at_step),), nodes=3, final_step=final,
                    etcd_members=INJECTORS[kind].etcd_members, name=kind)


# Need the checkpoint directory on a small filesystem: its own test below mounts one. (The
# network faults, also left out of the default draw, are test_net_injectors.py's.)
MOUNTED = {k for k, cls in INJECTORS.items() if not cls.drawn_by_default and not cls.network}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", default_kinds())
def test_each_injector_is_recovered_with_every_invariant(kind, tmp_path, job_id):
    result, _, metrics = run_checked(one_fault(kind), tmp_path, job_id)
    (fault,) = result.faults
    assert fault.t_inject is not None and fault.t_recovered is not None
    detail = fault.detail
    if kind in ("worker-kill", "oom-kill", "agent-kill", "daemon-kill", "checkpoint-write-kill"):
        assert detail["pid"] > 0
    if kind == "oom-kill":
        assert detail["rss_bytes"] > 0
    if kind == "daemon-kill":
        # Its agent and workers did not outlive it (they would be orphans beside the new ones).
        assert detail["processes_below"] >= 3 and detail["orphans_after_hold"] == [], detail
    if kind == "drain":
        assert detail["drain_exit_code"] == 0
        assert metrics[0].steps_lost == 0
    if kind == "checkpoint-write-kill":
        # The kill caught a write before its commit (a temp file or no manifest yet).
        assert detail["in_flight"], detail
    if kind == "etcd-leader-kill":
        # The leader was killed and another elected; no step lost, no pause (workers never
        # wait on etcd; the daemons hold every endpoint).
        assert detail["member"] and detail["new_leader_after_s"] is not None, detail
        assert metrics[0].steps_lost == 0 and metrics[0].etcd_outage_s <= 5, metrics
    if kind == "etcd-quorum-loss":
        assert len(detail["members"]) == 2 and detail["no_leader_while_held"], detail
        assert metrics[0].steps_lost == 0, metrics
    if kind == "preemption-notice":
        assert detail["drain_exit_code"] == 0 and detail["drained_s"] < detail["deadline_s"], detail
        assert metrics[0].steps_lost == 0
    if kind == "flapping-node":
        assert detail["flaps"] == 3 and len(set(detail["daemon_pids"])) == 3, detail
    if kind == "checkpoint-corrupt":
        # The job did load again after the damage, and that load skipped the damaged step.
        resumes = [r for r in rank0_records(result.progress)
                   if r["event"] == "resumed" and r["time"] > fault.t_inject]
        assert resumes and all(r["step"] != detail["step"] for r in resumes), resumes
        skipped = [e for n in ("a", "b", "c") for e in json_lines(result.root / n / "agent.log")
                   if e.get("event") == "checkpoint_skipped" and e.get("step") == detail["step"]]
        assert skipped, "no load skipped the damaged checkpoint"


@pytest.fixture
def small_ckpt_fs(tmp_path):
    """<tmp_path>/cluster/ckpt on an 8 MiB tmpfs (root only), unmounted however the test ends."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    ckpt = tmp_path / "cluster" / "ckpt"
    ckpt.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(ckpt)], check=True)
    try:
        yield ckpt
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)


@pytest.mark.timeout(900)
def test_a_full_checkpoint_filesystem_loses_no_committed_checkpoint(small_ckpt_fs, tmp_path, job_id):
    result, _, metrics = run_checked(one_fault("checkpoint-dir-full", final=900), tmp_path, job_id)
    (fault,) = result.faults
    assert fault.detail["filled_bytes"] > 0 and fault.detail["free_bytes"] == 0, fault.detail
    assert not (small_ckpt_fs / FILLER).exists()
    # Saves failed while it was full, and commits came back once it was freed.
    events = [e for n in ("a", "b", "c") for e in json_lines(result.root / n / "agent.log")]
    committed_after = [e for e in events if e.get("event") == "checkpoint_committed"
                       and (record_time(e) or 0) > fault.t_heal]
    assert committed_after, "no checkpoint committed once the space was back"


class _KillTheDaemonsMember(EtcdLeaderKill):
    """The weakened system's fault: kill the one member the daemons were given (the
    leader or not) for 8 s, longer than a leader change may take."""

    hold_s = 8.0

    def inject(self, t, victim):
        cluster = etcd_cluster(t)
        self._old = cluster.members[0]
        was_leader = cluster.leader() is self._old
        cluster.kill(self._old)
        return {"member": self._old.name, "was_leader": was_leader}


@pytest.mark.timeout(900)
def test_the_etcd_outage_check_bites_when_the_daemons_hold_one_member(tmp_path, job_id, monkeypatch):
    """Weakened on purpose: every daemon (and agent) gets one endpoint, the first member's,
    as a config written for a single etcd would; that member's kill cuts them off until
    it is restarted, and etcd-outage-bounded fails, naming the fault."""
    monkeypatch.setattr(Cluster, "endpoint", property(lambda self: self.etcd.endpoints[0]))
    monkeypatch.setitem(INJECTORS, "etcd-leader-kill", _KillTheDaemonsMember)
    result = run_scenario(one_fault("etcd-leader-kill", final=500), tmp_path / "cluster", job=job_id)
    checks, metrics = check_all(result)
    failed = {c.name: c for c in checks if not c.passed}
    assert "etcd-outage-bounded" in failed, checks
    assert failed["etcd-outage-bounded"].fault == "#0 etcd-leader-kill"
    assert metrics[0].etcd_outage_s > LEADER_CHANGE_S, metrics
