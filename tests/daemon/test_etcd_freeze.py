"""A frozen etcd (SIGSTOP: its kernel still accepts connections, nothing answers) must not
stall the daemon's loop: the systemd watchdog keeps getting pings, training goes on,
and membership (and a recovery that needs etcd) resumes within seconds of etcd's return.

Real etcd, real daemons under a fake NOTIFY_SOCKET with a short WatchdogSec, real torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.rendezvous.keys import JobKeys
from tests.daemon_nodes import DaemonNode, stepping_at, stop_nodes, wait_for

WATCHDOG_S = 4.0       # systemd would kill a daemon that sends no WATCHDOG=1 for this long
FREEZE_S = 9.0         # longer than the watchdog interval and the node lease (5 s)


class Pings:
    """A fake systemd notify socket that timestamps every WATCHDOG=1."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.1)
        self.path = path
        self.times: list[float] = []
        self._closed = threading.Event()
        # Read all the time, as systemd does: a full queue would block the daemon's sends.
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                data = self.sock.recv(4096)
            except (TimeoutError, OSError):
                continue
            if b"WATCHDOG=1" in data.split(b"\n"):
                self.times.append(time.monotonic())

    def drain(self) -> list[float]:
        return self.times

    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": str(int(WATCHDOG_S * 1e6))}

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def cluster(tmp_path, job_id, fresh_etcd):
    nodes: list[DaemonNode] = []
    pings: dict[str, Pings] = {}

    def add(name: str) -> DaemonNode:
        pings[name] = Pings(str(tmp_path / f"{name}.sock"))
        node = DaemonNode(name, fresh_etcd.endpoint, job_id, tmp_path, {"min_nodes": 1},
                          env=pings[name].env()).start()
        nodes.append(node)
        return node

    yield add, nodes, pings
    os.kill(fresh_etcd.proc.pid, signal.SIGCONT)
    stop_nodes(nodes)
    for p in pings.values():
        p.close()


def _freeze(etcd, pings: dict[str, Pings], names: list[str], during=None) -> tuple[float, float]:
    """SIGSTOP etcd for FREEZE_S (calling ``during`` once frozen); pings seen meanwhile."""
    for p in pings.values():
        p.drain()
    start = time.monotonic()
    os.kill(etcd.proc.pid, signal.SIGSTOP)
    try:
        if during is not None:
            during()
        while time.monotonic() - start < FREEZE_S:
            time.sleep(0.2)
            for p in pings.values():
                p.drain()
    finally:
        os.kill(etcd.proc.pid, signal.SIGCONT)
    thawed = time.monotonic()
    for name in names:
        seen = [t for t in pings[name].times if start <= t <= thawed]
        gaps = [b - a for a, b in zip([start, *seen], [*seen, thawed], strict=True)]
        assert len(seen) >= 3, f"{name}: {len(seen)} watchdog pings during a {FREEZE_S} s etcd freeze"
        assert max(gaps) < WATCHDOG_S, f"{name}: {max(gaps):.1f} s without a watchdog ping"
    return start, thawed


def _steps(node: DaemonNode) -> int:
    return (node.progress() or {}).get("step", -1)


@pytest.mark.slow
def test_a_frozen_etcd_stops_neither_pings_nor_training(fresh_etcd, cluster, job_id):
    add, nodes, pings = cluster
    a, b = add("a"), add("b")
    wait_for(lambda: stepping_at([a, b], 2, 0), 120, "world of 2", nodes)
    before = {n.name: _steps(n) for n in (a, b)}
    _freeze(fresh_etcd, pings, ["a", "b"])
    during = {n.name: _steps(n) for n in (a, b)}
    assert all(during[k] >= before[k] + 10 for k in before), (before, during)   # 0.05 s steps

    # Membership recovers: both records are back in etcd, and nobody was evicted.
    client = EtcdClient(EtcdSettings(endpoints=(fresh_etcd.endpoint,)))
    try:
        keys = JobKeys(job_id)
        wait_for(lambda: client.get(keys.node("a")) and client.get(keys.node("b")), 30,
                 "both node records back after the freeze", nodes)
    finally:
        client.close()
    thawed = time.time()
    wait_for(lambda: stepping_at([a, b], 2, thawed), 30, "world of 2 stepping after the freeze", nodes)
    assert a.running() and b.running()
    for node in (a, b):
        events = [e["event"] for e in node.daemon_events()]
        assert not any(e.startswith("peer(s) ") for e in events), events


@pytest.mark.slow
def test_a_peer_crash_during_an_etcd_freeze_recovers_once_etcd_returns(fresh_etcd, cluster):
    add, nodes, pings = cluster
    a, b = add("a"), add("b")
    wait_for(lambda: stepping_at([a, b], 2, 0), 120, "world of 2", nodes)
    _, thawed = _freeze(fresh_etcd, pings, ["a"], during=b.kill)
    thawed_wall = time.time()
    wait_for(lambda: stepping_at([a], 1, thawed_wall), 30, "a stepping alone after etcd returned", nodes)
    recovered_s = time.monotonic() - thawed
    print(f"survivor stepping again {recovered_s:.1f} s after etcd returned")
    events = [e["event"] for e in a.daemon_events()]
    assert any("peer(s) b lost" in e for e in events), events
    pings["a"].drain()
    assert a.running()
