"""Real daemons on one machine: real etcd, real torchrun agents, real gloo workers.

Each test ends with the autouse leak check: no process of the cluster may be left.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from elasticd import proctree
from tests.daemon_nodes import DaemonNode, log_lines, stepping_at, stop_nodes, wait_for

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process


@pytest.fixture
def cluster(tmp_path, job_id):
    nodes: list[DaemonNode] = []

    def add(name: str, endpoint: str, **config_kw) -> DaemonNode:
        node = DaemonNode(name, endpoint, job_id, tmp_path, config_kw).start()
        nodes.append(node)
        return node

    yield add, nodes
    stop_nodes(nodes)


def _rank0(nodes):
    return next(n for n in nodes if (n.progress() or {}).get("rank") == 0)


@pytest.mark.parametrize("rounds", ["torch", "keyed"])
def test_crash_join_and_rank0_loss(etcd_server, cluster, rounds):
    add0, nodes = cluster

    def add(name: str, endpoint: str) -> DaemonNode:
        return add0(name, endpoint, sections=f'[rendezvous]\nrounds = "{rounds}"\n')

    a, b, c = (add(n, etcd_server.endpoint) for n in "abc")
    wait_for(lambda: stepping_at([a, b, c], 3, 0), 120, "world of 3", nodes)

    victim = next(n for n in (a, b, c) if n.progress()["rank"] != 0)
    survivors = [n for n in (a, b, c) if n is not victim]
    crash = time.time()
    victim.kill()
    wait_for(lambda: stepping_at(survivors, 2, crash), 60, f"world 2 after {victim.name} crashed", nodes)
    lines = [e["event"] for n in survivors for e in log_lines(n)]
    assert any(e.startswith(f"peer(s) {victim.name} lost; evicting them") for e in lines)

    joined = time.time()
    d = add("d", etcd_server.endpoint)
    wait_for(lambda: stepping_at([*survivors, d], 3, joined), 90, "world 3 after d joined", nodes)

    live = [*survivors, d]
    rank0 = _rank0(live)
    rest = [n for n in live if n is not rank0]
    crash0 = time.time()
    rank0.kill()
    wait_for(lambda: stepping_at(rest, 2, crash0), 60, f"world 2 after rank-0 node {rank0.name} died",
             nodes)


def test_silent_node_is_evicted_after_its_lease(etcd_server, cluster):
    add, nodes = cluster
    a, b, c = (add(n, etcd_server.endpoint) for n in "abc")
    wait_for(lambda: stepping_at([a, b, c], 3, 0), 120, "world of 3", nodes)
    stopped = c if c.progress()["rank"] != 0 else b
    rest = [n for n in (a, b, c) if n is not stopped]
    frozen = time.time()
    stopped.signal_tree(signal.SIGSTOP)
    wait_for(lambda: stepping_at(rest, 2, frozen), 5 + 30, "world 2 after a node went silent", nodes)
    lines = [e["event"] for n in rest for e in log_lines(n)]
    assert any(e.startswith(f"peer(s) {stopped.name} lost") for e in lines)


@pytest.mark.slow
def test_etcd_restart_during_training(fresh_etcd, cluster):
    add, nodes = cluster
    a, b = (add(n, fresh_etcd.endpoint, min_nodes=2) for n in "ab")
    wait_for(lambda: stepping_at([a, b], 2, 0), 120, "world of 2", nodes)
    step_before = a.progress()["step"]
    fresh_etcd.kill()
    down = time.time()
    time.sleep(6)   # longer than the 5 s lease TTL
    progressed = a.progress()
    assert progressed["step"] > step_before and progressed["time"] > down + 4, \
        "training stopped while etcd was down"
    fresh_etcd.start()
    # membership recovers: both records are back, nobody was evicted, training goes on
    from elasticd.etcd_client import EtcdClient, EtcdSettings
    client = EtcdClient(EtcdSettings(endpoints=(fresh_etcd.endpoint,)))
    prefix = f"/elasticd/{a.job}/nodes/"
    wait_for(lambda: len(client.get_prefix(prefix)) == 2, 30, "both node records back", nodes)
    restart = time.time()
    wait_for(lambda: stepping_at([a, b], 2, restart), 30, "steps after the etcd restart", nodes)
    assert a.proc.poll() is None and b.proc.poll() is None
    client.close()


@pytest.mark.slow
def test_job_completion_is_recorded_and_every_daemon_exits_0(etcd_server, cluster, tmp_path):
    from tests.daemon_nodes import MLP
    add, nodes = cluster
    entry = [MLP, "--max-steps", "30", "--log-every", "10"]
    a, b = (add(n, etcd_server.endpoint, min_nodes=2, entrypoint=entry) for n in "ab")
    assert a.proc.wait(timeout=120) == 0 and b.proc.wait(timeout=60) == 0
    assert a.progress()["step"] == 30
    status = subprocess.run([sys.executable, "-m", "elasticd", "status", "--config", str(a.config_path),
                             "--json"], capture_output=True, text=True, check=True)
    result = json.loads(status.stdout)
    assert result["state"] == "completed"
    assert result["checkpoint"]["step"] == 30
    kinds = [e["kind"] for e in result["events"]]
    assert "job-completed" in kinds and "agent-started" in kinds


@pytest.mark.slow
def test_crash_loop_marks_the_node_failed(etcd_server, cluster, tmp_path):
    add, nodes = cluster
    script = tmp_path / "crash.py"
    script.write_text("import sys; sys.exit(3)\n")
    a = add("a", etcd_server.endpoint, entrypoint=[str(script)],
            extra="crash_loop_failures = 3")
    assert a.proc.wait(timeout=120) == 3   # FAILED_EXIT_CODE: systemd does not restart it
    events = [e["event"] for e in log_lines(a)]
    assert any("3 times without progress" in e and "marking this node failed" in e
               for e in events), events
    # Its record went with it; `elasticd status` says so from the journal, not "running".
    status = subprocess.run([sys.executable, "-m", "elasticd", "status", "--config", str(a.config_path)],
                            capture_output=True, text=True)
    assert status.returncode == 3, status    # a failed job's status exits 3 (failed)
    state = status.stdout.splitlines()[0]
    assert state.startswith(f"job {a.job}: failed: every node marked failed (a: "), status.stdout
    assert "3 times without progress" in state, status.stdout


@pytest.mark.slow
def test_a_node_whose_workers_cannot_start_names_their_error_when_it_is_marked_failed(
        etcd_server, cluster, tmp_path):
    """Before: the sentence said only "crashed 3 times without progress"; the cause (here
    the one a checkpoint directory that cannot be created gives) was in agent.log alone."""
    add, nodes = cluster
    script = tmp_path / "cannot_start.py"
    script.write_text("raise PermissionError(\"[Errno 13] Permission denied: '/ckpt/job'\")\n")
    a = add("a", etcd_server.endpoint, entrypoint=[str(script)], extra="crash_loop_failures = 3")
    assert a.proc.wait(timeout=120) == 3
    failed = [e for e in log_lines(a)
              if e.get("phase") == "failed" and "marking this node failed" in e["event"]]
    # In, not at the end: a bookkeeping note of the same cycle (the agent restarted its
    # workers after a crash) follows the phase decision when both land in one cycle.
    assert failed and ("; the workers' last error: PermissionError: [Errno 13] Permission "
                       "denied: '/ckpt/job'") in failed[0]["event"], failed


def test_sigkilled_daemon_leaves_no_orphans(etcd_server, cluster):
    add, nodes = cluster
    a = add("a", etcd_server.endpoint)
    wait_for(lambda: stepping_at([a], 1, 0), 120, "training", nodes)
    tree = proctree.descendants(a.proc.pid)
    assert len(tree) >= 2, "expected an agent and a worker"
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait()
    gone = proctree.wait_for(lambda: not any(p.is_running() and p.status() != "zombie" for p in tree),
                             10)
    proctree.reap_children()
    assert gone, [p.pid for p in tree if p.is_running()]
