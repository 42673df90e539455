"""Plain torchrun with ``--rdzv-backend=etcd3``: real agents, real gloo workers, real etcd."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.torchrun_nodes import (
    FAST_RDZV_CONF,
    TorchrunNode,
    latest,
    reports,
    stop_all,
    wait_until,
    world_after,
)

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process


@pytest.fixture
def cluster(tmp_path, job_id):
    nodes: list[TorchrunNode] = []

    def add(name: str, endpoint: str, **kw) -> TorchrunNode:
        node = TorchrunNode(name, endpoint, job_id, tmp_path, **kw).start()
        nodes.append(node)
        return node

    yield add, nodes
    for node in nodes:
        node.kill()


def _all_steps_correct(report_dir) -> None:
    bad = [r for recs in reports(report_dir).values() for r in recs if not r["ok"]]
    assert not bad, f"all-reduce gave wrong sums: {bad[:3]}"


def _force_restart(report_dir, victim: str, nodes, what: str) -> None:
    """SIGKILL ``victim``'s worker; wait until every node steps in a new worker at world 2."""
    old = {n.name: latest(report_dir, n.name)["pid"] for n in nodes}
    os.kill(old[victim], signal.SIGKILL)
    wait_until(lambda: all((rec := latest(report_dir, n)) and rec["pid"] != old[n] and rec["world"] == 2
                           for n in old), 60, what, nodes)


@pytest.mark.parametrize("rounds", ["torch", "keyed"])
def test_three_nodes_survive_crash_rejoin_and_rank0_loss(etcd_server, cluster, tmp_path, rounds):
    add0, nodes = cluster
    conf = f"{FAST_RDZV_CONF},rounds={rounds}"

    def add(name: str, endpoint: str) -> TorchrunNode:
        return add0(name, endpoint, rdzv_conf=conf)

    a, b, c = (add(n, etcd_server.endpoint) for n in "abc")
    start = time.time()
    wait_until(lambda: world_after(tmp_path, ["a", "b", "c"], 3, start), 90, "world of 3", nodes)

    victim = next(n for n in (a, b, c) if latest(tmp_path, n.name)["rank"] != 0)
    survivors = [n.name for n in (a, b, c) if n is not victim]
    crash = time.time()
    victim.kill()
    wait_until(lambda: world_after(tmp_path, survivors, 2, crash), 60,
               f"survivors {survivors} at world 2 after SIGKILL of {victim.name}", nodes)

    joined = time.time()
    d = add("d", etcd_server.endpoint)
    names = [*survivors, "d"]
    wait_until(lambda: world_after(tmp_path, names, 3, joined), 60, "world of 3 after d joins", nodes)

    rank0 = next(n for n in nodes if n.name in names and latest(tmp_path, n.name)["rank"] == 0)
    rest = [n for n in names if n != rank0.name]
    crash0 = time.time()
    rank0.kill()
    wait_until(lambda: world_after(tmp_path, rest, 2, crash0), 60,
               f"{rest} continue at world 2 after the rank-0 node {rank0.name} died", nodes)

    live = [n for n in nodes if n.name in rest]
    assert stop_all(live, tmp_path) == [0, 0]
    _all_steps_correct(tmp_path)
    assert d is not None


@pytest.mark.slow
def test_twenty_forced_worker_restarts(etcd_server, cluster, tmp_path):
    add, nodes = cluster
    for name in "ab":
        add(name, etcd_server.endpoint, nnodes="2", step_sleep=0.05)
    wait_until(lambda: world_after(tmp_path, ["a", "b"], 2, 0), 90, "world of 2", nodes)
    for restart in range(1, 21):
        _force_restart(tmp_path, "ab"[restart % 2], nodes, f"forced restart {restart} of 20")
    assert stop_all(nodes, tmp_path) == [0, 0]
    _all_steps_correct(tmp_path)


@pytest.mark.slow
def test_etcd_restart_is_survived_and_training_never_waits_on_etcd(fresh_etcd, cluster, tmp_path):
    add, nodes = cluster
    for name in "ab":
        add(name, fresh_etcd.endpoint, nnodes="2")
    wait_until(lambda: world_after(tmp_path, ["a", "b"], 2, 0), 90, "world of 2", nodes)

    fresh_etcd.kill()
    outage = time.time()
    time.sleep(4)
    during = [r for r in reports(tmp_path)["a-0"] if r["t"] > outage + 0.5]
    assert len(during) >= 5, "training steps stopped while etcd was down"
    fresh_etcd.start()

    # A new round after the restart: force it by killing a worker.
    _force_restart(tmp_path, "b", nodes, "a new round at world 2 after the etcd restart")
    assert all(n.proc.poll() is None for n in nodes), "an agent died during the etcd outage"
    assert stop_all(nodes, tmp_path) == [0, 0]
    _all_steps_correct(tmp_path)


# Keep-alive as shipped (not FAST_RDZV_CONF's 1 s x 3): a peer that does not leave is
# forgotten only after 5 s x 3, or its liveness lease's expiry.
SLOW_KEEPALIVE = "last_call_timeout=1,keep_alive_interval=5,keep_alive_max_attempt=3,join_timeout=120"


@pytest.mark.slow
@pytest.mark.parametrize("rounds", ["torch", "keyed"])
def test_an_agent_stopped_by_sigterm_leaves_the_rendezvous_so_the_others_do_not_wait_for_it(
        etcd_server, cluster, tmp_path, rounds):
    """torch skips the handler's shutdown when its agent dies of a signal: the leaver stayed
    a member until its keep-alive ran out (measured: a graceful SIGTERM cost 16.5 s). Now it
    leaves at interpreter exit, and the survivor trains alone well before 15 s."""
    add, nodes = cluster
    a, b = (add(n, etcd_server.endpoint, nnodes="1:2", rdzv_conf=f"{SLOW_KEEPALIVE},rounds={rounds}")
            for n in "ab")
    wait_until(lambda: world_after(tmp_path, ["a", "b"], 2, 0), 90, "world of 2", nodes)
    stopped = time.time()
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(timeout=60) != 0
    assert "leaving the rendezvous open for the others" in b.log_path.read_text()
    wait_until(lambda: world_after(tmp_path, ["a"], 1, stopped), 60, "a alone at world 1", nodes)
    alone = min(r["t"] for r in reports(tmp_path)["a-0"] if r["world"] == 1 and r["t"] > stopped)
    assert alone - stopped < 13, f"a waited {alone - stopped:.1f} s for the leaver"
    assert stop_all([a], tmp_path) == [0]
    _all_steps_correct(tmp_path)
