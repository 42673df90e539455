"""Chaos: a seeded sequence of faults against a 3-node job (`make chaos`), on the harness
(elasticd.lab.chaos). By default every injector once, in an order drawn from the seed (the
network faults in a sequence of their own, on the cluster's own network);
``CHAOS_SEED=N`` replays a sequence, ``CHAOS_ROUNDS=N`` draws N faults (with repeats).
The overlapping sequence pairs the loopback faults: the second of each pair fires in a
drawn phase of the first one's recovery, 0-2 s after that phase began (scenario.PHASES).
After each fault the job must be back to a world of 3; at the end every invariant of
elasticd.lab.chaos.invariants must hold (the replay oracle, exactly-once, contiguous steps,
intact checkpoints, no corrupt load, bounded recovery, no process left, completion).
"""

from __future__ import annotations

import os
import random
import time

import pytest

from elasticd.lab import netlab
from elasticd.lab.chaos.faults import INJECTORS
from elasticd.lab.chaos.scenario import draw
from tests.chaos.common import run_checked
from tests.chaos.test_injectors import MOUNTED

pytestmark = pytest.mark.chaos


def sequence_kinds(network: bool) -> list[str]:
    """The kinds of one sequence: the network faults run on a network of their own (one
    etcd member, no metadata server), everything else on loopback; checkpoint-dir-full
    needs a small tmpfs under the checkpoint directory and has its own test
    (test_injectors.py), which mounts one."""
    return sorted(k for k, cls in INJECTORS.items() if k not in MOUNTED and cls.network == network)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("network", "overlap"), [(False, False), (True, False), (False, True)],
                         ids=["loopback", "network", "overlap"])
def test_random_fault_sequence(tmp_path, job_id, network, overlap):
    if network and (why := netlab.available() or netlab.iptables_available()):
        pytest.skip(why)
    seed = int(os.environ.get("CHAOS_SEED", time.time()))
    rounds = os.environ.get("CHAOS_ROUNDS")
    every = sequence_kinds(network)
    kinds = every if rounds is None else random.Random(seed).choices(every, k=int(rounds))
    sc = draw(seed, kinds, overlap=overlap)   # FAULT_STEPS per fault
    print(f"chaos seed {seed}: {[(f.kind, f.when()) for f in sc.faults]}")
    run_checked(sc, tmp_path, job_id)
