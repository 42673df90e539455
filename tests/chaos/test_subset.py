"""The chaos suite's fast subset, in the default run: two cheap faults on a 3-node job
(a worker SIGKILL, an etcd crash and restart), then every invariant. The full matrix is
`make chaos`. The job is long enough that the faults land, and recover, before its end
on a loaded 2-core machine (200 steps were not: the other two nodes finished the job in a
world of 2 while the killed worker's node was still rejoining)."""

from __future__ import annotations

import pytest

from elasticd.lab.chaos.scenario import FaultSpec, Scenario
from tests.chaos.common import run_checked

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process

SUBSET = Scenario(seed=3, nodes=3, final_step=700, faults=(
    FaultSpec("worker-kill", "other", 30),
    FaultSpec("etcd-restart", "any", 60),
), name="ci-subset")


@pytest.mark.timeout(600)
def test_the_fast_subset_keeps_every_invariant(tmp_path, job_id):
    result, checks, metrics = run_checked(SUBSET, tmp_path, job_id)
    assert [c.name for c in checks] == [
        "faults-recovered", "job-completed", "steps-contiguous", "replay-oracle",
        "samples-exactly-once", "checkpoints-intact", "no-corrupt-load", "recovery-bounded",
        "etcd-outage-bounded", "no-stale-commit", "liveness-bounded", "no-process-left"]
    assert len(metrics) == 2
