"""An agent that gives up must not close the rendezvous for everyone (real torchrun, real etcd).

torch's agent calls ``rdzv_handler.shutdown()`` whenever it exits but by a signal; torch's
handler then marks the shared state closed and every agent fails with
``RendezvousClosedError`` from then on. Ours closes only after success.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import time

import pytest
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd import proctree
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.rendezvous import admin
from elasticd.rendezvous.keys import JobKeys
from tests.torchrun_nodes import (
    FAST_RDZV_CONF,
    TorchrunNode,
    latest,
    stop_all,
    wait_until,
    world_after,
)


@pytest.fixture
def cluster(tmp_path, job_id, etcd_server):
    nodes: list[TorchrunNode] = []

    def add(name: str, **kw) -> TorchrunNode:
        node = TorchrunNode(name, etcd_server.endpoint, job_id, tmp_path, **kw).start()
        nodes.append(node)
        return node

    yield add, nodes
    for node in nodes:
        node.kill()


@pytest.fixture
def closed(etcd_server, job_id):
    """Whether the rendezvous is closed, on either layout (keyed rounds have no round to
    view before a world formed: their ``closed`` key says it)."""
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    keys = JobKeys(job_id)

    def read() -> bool:
        view = admin.current_round(client, keys)
        return client.get(keys.rdzv_closed) is not None or (view is not None and view.closed)

    yield read
    client.close()


def _exit_code(node: TorchrunNode, timeout_s: float) -> int:
    try:
        return node.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{node.name} did not exit in {timeout_s} s\n{node.log_tail()}") from None


@pytest.mark.slow
@pytest.mark.parametrize("rounds", ["keyed", "torch"])
def test_a_join_timeout_does_not_close_the_rendezvous(cluster, closed, tmp_path, rounds):
    add, nodes = cluster
    conf = f"{FAST_RDZV_CONF},rounds={rounds}"
    # Alone where two nodes are needed: its join times out after 3 s and the agent exits.
    lonely = add("z", nnodes="2", rdzv_conf=conf.replace("join_timeout=120", "join_timeout=3"))
    assert _exit_code(lonely, 90) != 0
    assert "RendezvousTimeoutError" in lonely.log_tail(20000)
    assert not closed(), "the agent's shutdown closed the rendezvous"
    start = time.time()
    for name in "ab":
        add(name, nnodes="2", rdzv_conf=conf)
    wait_until(lambda: world_after(tmp_path, ["a", "b"], 2, start), 90,
               "a and b form a world after the timed-out agent left", nodes)
    assert stop_all(nodes[1:], tmp_path) == [0, 0]
    assert closed(), "after success the rendezvous is closed, as torch does"


@pytest.mark.slow
def test_an_agent_out_of_restarts_does_not_close_the_rendezvous(cluster, closed, tmp_path):
    add, nodes = cluster
    a = add("a", nnodes="1:3")
    b = add("b", nnodes="1:3", max_restarts=2)
    start = time.time()
    wait_until(lambda: world_after(tmp_path, ["a", "b"], 2, start), 90, "a world of 2", nodes)
    # Crash b's workers until its agent gives up (2 restarts; gloo errors may use some too).
    for kill in range(1, 6):
        old_pid = latest(tmp_path, "b")["pid"]
        os.kill(old_pid, signal.SIGKILL)
        if not proctree.wait_for(lambda pid=old_pid: b.proc.poll() is not None or (
                (r := latest(tmp_path, "b")) and r["pid"] != pid and r["world"] == 2), 60, 0.1):
            raise AssertionError(f"b neither restarted nor exited after kill {kill}\n{b.log_tail()}")
        if b.proc.poll() is not None:
            break
    assert _exit_code(b, 30) != 0, "b should have used up its restarts"
    assert "ChildFailedError" in b.log_tail(20000) or "exitcode" in b.log_tail(20000)
    gave_up = time.time()
    assert not closed(), "the agent out of restarts closed the rendezvous"
    wait_until(lambda: world_after(tmp_path, ["a"], 1, gave_up), 60, "a goes on alone", nodes)
    joined = time.time()
    add("c", nnodes="1:3")
    wait_until(lambda: world_after(tmp_path, ["a", "c"], 2, joined), 90, "a new node c joins a", nodes)
    assert a.proc.poll() is None
    assert stop_all([a, nodes[2]], tmp_path) == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("rounds", ["keyed", "torch"])
def test_reopen_if_closed_lets_agents_join_a_closed_rendezvous(cluster, etcd_server, job_id, tmp_path,
                                                              rounds):
    """The daemon's repair for a state closed by anything else (an older plugin, an operator)."""
    add, nodes = cluster
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    keys = JobKeys(job_id)
    conf = f"{FAST_RDZV_CONF},rounds={rounds}"
    try:
        if rounds == "torch":
            state = dyn._RendezvousState()
            state.closed = True
            client.put(keys.rdzv_state, pickle.dumps(state))
        else:
            client.put(keys.rdzv_closed, b"{}")
        refused = add("x", nnodes="1", rdzv_conf=conf)
        assert _exit_code(refused, 60) != 0
        # Either layout ends the agent's output with what happened and the fix (torch's own
        # error is bare).
        last = refused.log_path.read_text().rstrip().splitlines()[-1]
        assert last.startswith("torch.distributed.elastic.rendezvous.api.RendezvousClosedError: "
                               f"the rendezvous of run '{job_id}' is closed: "), last
        assert last.endswith(f"del --prefix /elasticd/{job_id}/"), last
        assert admin.reopen_if_closed(client, keys, deadline_s=2.0)
        start = time.time()
        a = add("a", nnodes="1", rdzv_conf=conf)
        wait_until(lambda: world_after(tmp_path, ["a"], 1, start), 60, "a joins the reopened rendezvous",
                   nodes)
        assert stop_all([a], tmp_path) == [0]
    finally:
        client.close()


def test_the_leaves_at_exit_of_one_process_share_one_time_budget(monkeypatch):
    """A process with many agents (a test session) leaves each at exit in turn; with etcd
    gone each used its whole budget (53 held CI's exit 3.5 min). Past the process's total
    the others are not tried: their leases expire by themselves."""
    from elasticd.rendezvous import leaving

    class Agent(leaving.LeavesOnExit):
        tried = 0

        def _leave(self, success: bool) -> bool:
            Agent.tried += 1
            time.sleep(0.3)   # etcd not answering, within the agent's own budget
            return False

    monkeypatch.setattr(leaving, "AT_EXIT_TOTAL_S", 0.5)
    monkeypatch.setattr(leaving, "_exit_spent", {"s": 0.0})
    agents = [Agent() for _ in range(5)]
    started = time.monotonic()
    for agent in agents:
        agent._leave_on_exit()
    assert Agent.tried == 2 and time.monotonic() - started < 1.0
    assert all(a._has_left for a in agents)
