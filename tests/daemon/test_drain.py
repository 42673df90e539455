"""Graceful drain (SIGTERM, `elasticd drain`, a cloud preemption notice), SIGHUP reload and
the systemd notify protocol, with real daemons, real torchrun and a fake metadata server."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from elasticd.lab.fake_metadata import FakeMetadata
from tests.daemon_nodes import (
    DaemonNode,
    agent_events,
    log_lines,
    stepping_at,
    stop_nodes,
    wait_for,
)

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process


@pytest.fixture
def cluster(tmp_path, job_id):
    nodes: list[DaemonNode] = []

    def add(name: str, endpoint: str, env=None, **config_kw) -> DaemonNode:
        node = DaemonNode(name, endpoint, job_id, tmp_path, config_kw, env or {}).start()
        nodes.append(node)
        return node

    yield add, nodes
    stop_nodes(nodes)


def _assert_zero_steps_lost(leaver: DaemonNode, survivors: list[DaemonNode], since: float) -> int:
    """The leaver's coordinated stop committed step S; the survivors resumed from exactly S."""
    stopped = [e for e in agent_events(leaver, "stopped") if e["time"] > since]
    assert stopped, "the drained node's workers never took the coordinated stop"
    step = stopped[-1]["step"]
    for node in survivors:
        resumed = [e for e in agent_events(node, "resumed") if e["time"] > since]
        assert resumed and resumed[0]["step"] == step, (node.name, step, resumed[:1])
    return step


def _assert_left_in_place(leaver: DaemonNode, survivors: list[DaemonNode], since: float) -> int:
    """The leaver's workers stopped after the agreed step S (``left``); every survivor
    re-formed in place after that same step, without its workers restarting."""
    stopped = [e for e in agent_events(leaver, "stopped") if e["time"] > since]
    assert stopped and {e["stop_reason"] for e in stopped} == {"left"}, stopped
    step = stopped[-1]["step"]
    for node in survivors:
        reformed = [e for e in agent_events(node, "reformed") if e["time"] > since]
        assert [(e["step"], e["cause"], e["lost"]) for e in reformed] == [
            (step, "drain", [leaver.name])] * len(reformed) and reformed, (node.name, reformed)
        assert not [e for e in agent_events(node, "resumed") if e["time"] > since], node.name
        sentences = [e["event"] for e in log_lines(node)]
        assert any("re-formed in place" in s and "after a drain" in s for s in sentences), sentences
    return step


def _drain_and_check(leaver, survivors, nodes, trigger, in_place: bool = True) -> None:
    # The steady state (every daemon has published its workers' world): a drain before it
    # has no agreed base and stops every rank instead.
    trio = [leaver, *survivors]
    wait_for(lambda: stepping_at(trio, 3, 0) and all(n.progress()["step"] >= 15 for n in trio),
             120, "world of 3 at step 15", nodes)
    start = time.time()
    trigger()
    assert leaver.proc.wait(timeout=90) == 0, leaver.log_tail()
    wait_for(lambda: stepping_at(survivors, 2, start), 60, "world 2 after the drain", nodes)
    check = _assert_left_in_place if in_place else _assert_zero_steps_lost
    step = check(leaver, survivors, start)
    events = [e["event"] for e in log_lines(leaver)]
    how = "in place" if in_place else "by a coordinated stop"
    assert any(e.startswith("draining because") and how in e for e in events), events
    assert "the agent stopped; leaving the job and exiting" in events
    assert step > 0


def _rank_nonzero(nodes):
    return next(n for n in nodes if n.progress()["rank"] != 0)


def test_sigterm_drains_in_place_with_zero_steps_lost(etcd_server, cluster):
    add, nodes = cluster
    trio = [add(n, etcd_server.endpoint) for n in "abc"]
    wait_for(lambda: stepping_at(trio, 3, 0), 120, "world of 3", nodes)
    leaver = _rank_nonzero(trio)
    rest = [n for n in trio if n is not leaver]
    _drain_and_check(leaver, rest, nodes, lambda: leaver.proc.send_signal(signal.SIGTERM))


def test_a_drain_in_restart_mode_stops_every_rank_with_zero_steps_lost(etcd_server, cluster):
    add, nodes = cluster
    trio = [add(n, etcd_server.endpoint, recovery="restart") for n in "abc"]
    wait_for(lambda: stepping_at(trio, 3, 0), 120, "world of 3", nodes)
    leaver = _rank_nonzero(trio)
    rest = [n for n in trio if n is not leaver]
    _drain_and_check(leaver, rest, nodes, lambda: leaver.proc.send_signal(signal.SIGTERM),
                     in_place=False)


@pytest.mark.slow
def test_elasticd_drain_command(etcd_server, cluster):
    add, nodes = cluster
    trio = [add(n, etcd_server.endpoint) for n in "abc"]
    wait_for(lambda: stepping_at(trio, 3, 0), 120, "world of 3", nodes)
    leaver = trio[0]

    def drain():
        subprocess.run([sys.executable, "-m", "elasticd", "drain", "--config", str(leaver.config_path),
                        "--reason", "maintenance"], check=True, capture_output=True)

    _drain_and_check(leaver, trio[1:], nodes, drain)


@pytest.mark.slow
def test_spot_notice_drains_its_node(etcd_server, cluster):
    add, nodes = cluster
    with FakeMetadata() as meta:
        spot = f"[preemption]\naws = true\nmetadata_url = \"{meta.url}\"\npoll_interval_s = 0.5\n"
        a, b = (add(n, etcd_server.endpoint) for n in "ab")
        c = add("c", etcd_server.endpoint, sections=spot)
        wait_for(lambda: stepping_at([a, b, c], 3, 0), 120, "world of 3", nodes)
        _drain_and_check(c, [a, b], nodes, meta.announce_aws)
        assert not meta.rejections
    events = [e["event"] for e in log_lines(c)]
    assert any("draining because a aws preemption notice arrived" in e for e in events), events


@pytest.mark.slow
def test_sighup_reloads_and_reports_the_diff(etcd_server, cluster):
    add, nodes = cluster
    a = add("a", etcd_server.endpoint)
    wait_for(lambda: stepping_at([a], 1, 0), 120, "training", nodes)
    text = a.config_path.read_text()
    text = text.replace("backoff_initial_s = 0.5", "backoff_initial_s = 2.0")
    text = text.replace("lease_ttl_s = 5", "lease_ttl_s = 7")
    a.config_path.write_text(text)
    a.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e["event"] == "config reloaded" for e in log_lines(a)), 20, "reload", nodes)
    line = next(e for e in log_lines(a) if e["event"] == "config reloaded")
    assert line["applied"] == {"supervisor.backoff_initial_s": [0.5, 2.0]}
    assert line["needs_restart"] == {"node.lease_ttl_s": [5, 7]}
    assert a.proc.poll() is None


@pytest.mark.slow
def test_systemd_notify_ready_status_watchdog_stopping(etcd_server, cluster, tmp_path):
    add, nodes = cluster
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    received: list[str] = []

    def collect(seconds: float) -> list[str]:
        got, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                got.append(sock.recv(4096).decode())
        received.extend(got)
        return got

    a = add("a", etcd_server.endpoint, env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    wait_for(lambda: (collect(0.5), any("READY=1" in m for m in received))[1], 90, "READY=1", nodes)
    wait_for(lambda: stepping_at([a], 1, 0), 120, "training", nodes)
    lively = collect(3)
    assert any(m == "WATCHDOG=1" for m in lively)
    assert any(m.startswith("STATUS=running: step") for m in received), received[-5:]

    a.proc.send_signal(signal.SIGSTOP)     # a hung main loop: no more pings
    collect(0.3)
    assert not [m for m in collect(3) if m == "WATCHDOG=1"]
    a.proc.send_signal(signal.SIGCONT)
    assert any(m == "WATCHDOG=1" for m in collect(3))

    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(timeout=60) == 0
    collect(0.5)
    assert "STOPPING=1" in received
    sock.close()


@pytest.mark.slow
def test_prometheus_metrics(etcd_server, cluster):
    import urllib.request

    from elasticd.lab.embedded_etcd import free_port
    add, nodes = cluster
    port = free_port()
    a = add("a", etcd_server.endpoint, sections=f"[metrics]\nport = {port}\n")
    wait_for(lambda: stepping_at([a], 1, 0), 120, "training", nodes)

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    wait_for(lambda: "elasticd_world_size 1.0" in scrape(), 20, "world size metric", nodes)
    text = scrape()
    assert 'elasticd_phase{phase="running"} 1.0' in text
    assert "elasticd_agent_starts_total 1.0" in text
    assert "elasticd_etcd_up 1.0" in text
