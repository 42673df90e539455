"""Injector helpers that need no cluster."""

from __future__ import annotations

import pytest

from elasticd.lab.chaos.faults import InjectionError, await_workers


def test_a_worker_fault_waits_for_a_worker_between_two_incarnations():
    """Seed 43's overlap run: a worker-kill fired while the node's workers were restarting
    found none and was never injected; it now waits for the next incarnation."""
    polls = iter([[], [], ["worker"]])
    assert await_workers(lambda: next(polls), "no worker", timeout_s=5) == ["worker"]


def test_a_worker_fault_that_never_finds_one_says_so():
    with pytest.raises(InjectionError, match="node c had no live worker within 0 s"):
        await_workers(list, "node c had no live worker", timeout_s=0.2)
