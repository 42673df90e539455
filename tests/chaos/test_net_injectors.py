"""Each network fault on a live 3-node job on the cluster's own network (marker chaos,
`make chaos`; root and iptables): the cut or the slowness is applied to one node, healed,
every invariant holds, and the system did what it must in that fault (below, per kind),
read from the daemons' logs and the rank-0 lineage. Nothing is left: no rule in the
victim's namespace after the heal, no namespace after the run (``no-process-left``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from elasticd.lab import netlab
from elasticd.lab.chaos.invariants import FaultMetrics
from elasticd.lab.chaos.net_faults import NET_INJECTORS
from elasticd.lab.chaos.run import SETTLE_S, FaultRecord
from elasticd.lab.chaos.scenario import FaultSpec
from elasticd.lab.local_cluster import json_lines, record_time
from tests.chaos.common import run_checked
from tests.chaos.test_injectors import one_fault

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(bool(netlab.available() or netlab.iptables_available()),
                       reason=str(netlab.available() or netlab.iptables_available())),
]


def daemon_events(root: Path, node: str, fault: FaultRecord, needle: str) -> list[dict]:
    """The node's daemon log lines with ``needle`` from the fault's injection to the end
    of the stable world that counted as its recovery (not the job's end: the first node
    to finish is "lost" to the others)."""
    until = (fault.t_recovered or float("inf")) + SETTLE_S
    return [r for r in json_lines(root / f"{node}.daemon.log")
            if needle in str(r.get("event", "")) and fault.t_inject <= (record_time(r) or 0) <= until]


def expect(kind: str, root: Path, nodes: list[str], fault: FaultRecord, m: FaultMetrics) -> None:
    """What the system must do in fault ``kind`` (beyond the invariants), read from the
    run's logs under ``root``; also usable on a kept ``elasticd chaos --keep`` run."""
    detail, victim = fault.detail, fault.target
    peers = [n for n in nodes if n != victim]
    assert detail.get("rules_left") == [] and detail.get("qdiscs_left", []) == [], detail
    if kind == "partition-etcd":
        # The data plane is whole: training never stops and loses nothing. The victim's
        # lease expires (its peers see the record go, probe it, find it alive and leave it
        # alone) and it registers again once etcd is back.
        assert m.recovery_s == 0.0 and m.steps_lost == 0, m
        assert all(daemon_events(root, p, fault, "vanished but it answers") for p in peers)
        assert daemon_events(root, victim, fault, "lease was lost; re-registering")
    if kind in ("partition-peers", "partition-peers-reject", "partition-peers-oneway"):
        # The victim's lease lives (it reaches etcd), so no lease decides: the majority
        # does (elasticd.quorum). Its peers suspect it (a reset at once, a silence after
        # the lease TTL; one way: its answers never arrive), evict it and re-form in place;
        # the victim (which suspects them both, a minority of one) finds itself cut off
        # from the majority, stops its own workers and fences out nobody; nobody counts a
        # crash; after the heal it rejoins.
        assert m.steps_lost == 0, m
        assert all(daemon_events(root, p, fault, "a majority of the members suspect") for p in peers)
        assert daemon_events(root, victim, fault, "cut off from the majority")
        assert not daemon_events(root, victim, fault, "a majority of the members suspect")
        assert not any(daemon_events(root, n, fault, "failure 1 of") for n in nodes)
    if kind in ("partition-oneway", "partition-oneway-in"):
        # The victim goes silent to its peers and to etcd: its lease expires, its peers
        # evict it and re-form in place without it; after the heal it finds the newer
        # generation agreed without it, kills its own workers (they are fenced out) and
        # rejoins as a new round through a coordinated stop: no step lost.
        assert m.steps_lost == 0, m
        assert all(daemon_events(root, p, fault, "lost; evicting") for p in peers)
        assert daemon_events(root, victim, fault, "agreed without this node")
    if kind == "netem":
        # Slower, never broken: no eviction, no restart, every packet through the delayer.
        assert m.steps_lost == 0 and detail["packets"]["held"] > 0, (m, detail)
        assert not any(daemon_events(root, n, fault, "evict") for n in nodes)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", sorted(cls.name for cls in NET_INJECTORS))
def test_each_network_fault_is_healed_with_every_invariant(kind, tmp_path, job_id):
    result, _, metrics = run_checked(one_fault(kind, final=500), tmp_path, job_id)
    (fault,) = result.faults
    (m,) = metrics
    print(f"{kind}: recovery {m.recovery_s} s, back to a world of 3 {m.back_to_full_s} s, "
          f"{m.steps_lost} steps lost")
    expect(kind, result.root, result.scenario.node_names(), fault, m)


# Longer than the hang bound: the cut node's workers, and the majority's while they wait
# on it, stall for over HANG_S; no healthy node may count that as its crash.
HANG_S = 10
LONG_CUT_S = 30.0


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["partition-peers", "partition-peers-reject", "partition-peers-oneway",
                                  "partition-oneway"])
def test_a_cut_longer_than_the_hang_bound_is_decided_by_the_majority(kind, tmp_path, job_id):
    sc = replace(one_fault(kind, final=700), supervisor={"hang_timeout_s": HANG_S},
                 faults=(FaultSpec(kind, "other", 40, for_s=LONG_CUT_S),))
    result, _, metrics = run_checked(sc, tmp_path, job_id)
    (fault,) = result.faults
    (m,) = metrics
    assert fault.detail["cut_s"] == LONG_CUT_S
    print(f"{kind} for {LONG_CUT_S:g} s (hang bound {HANG_S} s): recovery {m.recovery_s} s, "
          f"back to a world of 3 {m.back_to_full_s} s, {m.steps_lost} steps lost")
    expect(kind, result.root, result.scenario.node_names(), fault, m)
    nodes = result.scenario.node_names()
    assert not any(daemon_events(result.root, n, fault, "failure 1 of") for n in nodes)
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes


def expect_kept(report_dir: Path) -> None:
    """``expect`` on a kept CLI run: ``python -m tests.chaos.test_net_injectors OUT``."""
    report = json.loads((report_dir / "chaos.json").read_text())
    (raw,) = report["faults"]
    fault = FaultRecord(**{k: v for k, v in raw.items() if k != "metrics"})
    expect(raw["kind"], report_dir / "cluster", [chr(97 + i) for i in range(report["scenario"]["nodes"])],
           fault, FaultMetrics(**raw["metrics"]))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        expect_kept(Path(arg))
        print(f"{arg}: as expected")
