"""Chaos: a random sequence of faults against a 3-node job (`make chaos`).

Faults: SIGKILL of a whole node, SIGSTOP of a whole node for longer than its lease,
a drain by SIGTERM, and an etcd crash. After each, the victim is brought back and the
job must re-form a world of 3 and keep stepping. At the end: the newest checkpoint
loads and verifies, steps went forward across every fault, and no process is left
(the suite's autouse check).
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from checkpointing import CheckpointManager
from elasticd.local_cluster import LocalNode, stepping_at, stop_all
from tests.daemon_nodes import wait_for

pytestmark = pytest.mark.chaos
FAULTS = ("crash", "silent", "drain", "etcd")


def _max_step(nodes: list[LocalNode]) -> int:
    return max(((n.progress() or {}).get("step", 0) for n in nodes if n.running()), default=0)


@pytest.mark.timeout(1800)
def test_random_fault_sequence(fresh_etcd, tmp_path, job_id):
    seed = int(os.environ.get("CHAOS_SEED", time.time()))
    rounds = int(os.environ.get("CHAOS_ROUNDS", "6"))
    rng = random.Random(seed)
    print(f"chaos seed {seed}, {rounds} rounds")
    nodes = [LocalNode(n, fresh_etcd.endpoint, job_id, tmp_path).start() for n in "abc"]
    try:
        wait_for(lambda: stepping_at(nodes, 3, 0), 180, "world of 3", nodes)
        for i in range(rounds):
            fault = rng.choice(FAULTS)
            victim = rng.choice(nodes)
            before = _max_step(nodes)
            print(f"round {i}: {fault} on {victim.name} at step {before}")
            _inject(fault, victim, fresh_etcd)
            back = time.time()
            wait_for(lambda back=back: stepping_at(nodes, 3, back), 180,
                     f"world of 3 again after {fault} of {victim.name} (seed {seed})", nodes)
            assert _max_step(nodes) >= before - 20, "the job went back further than one checkpoint"
        final = CheckpointManager(tmp_path / "ckpt", read_only=True).load_latest()
        assert final is not None and final.step > 0
    finally:
        stop_all(nodes)


def _inject(fault: str, victim: LocalNode, etcd) -> None:
    if fault == "crash":
        victim.kill()
        time.sleep(2)
        victim.start()
    elif fault == "silent":
        victim.signal_tree(signal.SIGSTOP)
        time.sleep(8)                      # longer than the 5 s lease
        victim.signal_tree(signal.SIGCONT)
    elif fault == "drain":
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.proc.wait(timeout=90) == 0
        victim.start()
    elif fault == "etcd":
        etcd.kill()
        time.sleep(3)
        etcd.start()
