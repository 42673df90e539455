"""Chaos: a seeded sequence of faults against a 3-node job (`make chaos`), on the harness
(elasticd.chaos). By default every injector once, in an order drawn from the seed;
``CHAOS_SEED=N`` replays a sequence, ``CHAOS_ROUNDS=N`` draws N faults (with repeats).
After each fault the job must be back to a world of 3; at the end every invariant of
elasticd.chaos.invariants must hold (the replay oracle, exactly-once, contiguous steps,
intact checkpoints, no corrupt load, bounded recovery, no process left, completion).
"""

from __future__ import annotations

import os
import random
import time

import pytest

from elasticd.chaos.faults import INJECTORS
from elasticd.chaos.scenario import draw
from tests.chaos.common import run_checked
from tests.chaos.test_injectors import MOUNTED

pytestmark = pytest.mark.chaos
STEPS_PER_FAULT = 300   # a fault fires once the previous one recovered: steps go on meanwhile


@pytest.mark.timeout(3600)
def test_random_fault_sequence(tmp_path, job_id):
    seed = int(os.environ.get("CHAOS_SEED", time.time()))
    rounds = os.environ.get("CHAOS_ROUNDS")
    # checkpoint-dir-full needs the checkpoint directory on a small tmpfs: it has its own
    # test (test_injectors.py), which mounts one.
    every = sorted(set(INJECTORS) - MOUNTED)
    kinds = every if rounds is None else random.Random(seed).choices(every, k=int(rounds))
    sc = draw(seed, kinds, final_step=STEPS_PER_FAULT * len(kinds) + 200)
    print(f"chaos seed {seed}: {[f.kind for f in sc.faults]}")
    run_checked(sc, tmp_path, job_id)
