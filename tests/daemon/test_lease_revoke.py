"""A revoke is worth only the lease's remaining TTL: with etcd gone it gives up quickly.

CI once spent four minutes at one test process's exit: eight agents each revoked their
liveness lease against a stopped etcd, and each waited out the client's 30 s retry.
"""

from __future__ import annotations

import time

import pytest

from elasticd.lease import REVOKE_BUDGET_S, LeaseKeeper
from tests.conftest import connect

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process


def test_a_revoke_against_a_stopped_etcd_ends_within_its_budget(fresh_etcd):
    client = connect(fresh_etcd, retry_s=30)  # a retry far longer than the budget
    lease = LeaseKeeper(client, 30).start()
    fresh_etcd.stop()
    started = time.monotonic()
    lease.stop(revoke=True)  # logs "could not revoke lease", never raises
    # A liveness bound, not a speed claim: without the budget this took the 30 s retry.
    assert time.monotonic() - started < REVOKE_BUDGET_S + 5.0
    client.close()
