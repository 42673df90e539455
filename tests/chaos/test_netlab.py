"""The cluster's private network (elasticd.lab.netlab) and the network faults' mechanics,
without daemons (seconds): members reach each other and only each other; a cut, the
delayer and the heal do what they say; nothing is left behind, even when the block that
made it fails, and a crashed run's namespaces are swept. Needs root and iproute2; the
cuts need iptables (skipped without)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from elasticd.lab import netlab
from elasticd.lab.chaos import net_faults

pytestmark = pytest.mark.skipif(netlab.available() is not None, reason=str(netlab.available()))
needs_iptables = pytest.mark.skipif(netlab.iptables_available() is not None,
                                    reason=str(netlab.iptables_available()))


def _echo_server(net: netlab.Network, member: str, port: int = 5555) -> None:
    addr = net.members[member].addr
    server = netlab.call_in(net.members[member].netns, lambda: socket.create_server((addr, port)))

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(100):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()


def _connect(net: netlab.Network, src: str, dst: str, timeout: float = 2.0) -> socket.socket:
    addr = net.members[dst].addr
    return netlab.call_in(net.members[src].netns, lambda: socket.create_connection((addr, 5555), timeout))


def _rtt_ms(conn: socket.socket, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t = time.monotonic()
        conn.sendall(b"x")
        conn.recv(10)
        times.append(time.monotonic() - t)
    return sorted(times)[n // 2] * 1000


def test_members_reach_each_other_and_the_network_is_gone_after_the_block():
    with netlab.network() as net:
        net.add("a")
        net.add("b")
        _echo_server(net, "b")
        with _connect(net, "a", "b") as conn:
            assert conn.getsockname()[0] == net.members["a"].addr
            assert _rtt_ms(conn, 3) < 100
        names = [n for n in netlab.namespaces() if net.tag in n]
        assert {net.ns("a"), net.ns("b"), net.switch} <= set(names)
        # The members are on a subnet no route of the machine's own namespace knows.
        assert "10.77.0." not in subprocess.run(["ip", "route"], capture_output=True, text=True).stdout
    assert net.leftover() == [] and not set(names) & set(netlab.namespaces())


def test_the_network_is_removed_when_the_block_fails():
    with pytest.raises(RuntimeError, match="boom"), netlab.network() as net:
        net.add("a")
        raise RuntimeError("boom")
    assert net.leftover() == []


def test_a_crashed_runs_namespaces_are_swept_and_a_live_runs_are_not():
    # A process that makes a network and dies without closing it (SIGKILL: no finally).
    code = ("import os, signal; from elasticd.lab import netlab; n = netlab.Network().open(); n.add('a'); "
            "print(n.tag, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    tag = out.stdout.strip()
    assert tag and any(n.startswith(f"{netlab.PREFIX}-{tag}-") for n in netlab.namespaces()), out
    with netlab.network() as live:   # opening one sweeps the dead run's
        live.add("a")
        assert not any(tag in n for n in netlab.namespaces())
        assert netlab.sweep_stale() == [] and live.ns("a") in netlab.namespaces()


@needs_iptables
def test_a_cut_drops_what_it_names_and_its_heal_leaves_no_rule():
    with netlab.network() as net:
        for m in ("a", "b", "c"):
            net.add(m)
        _echo_server(net, "b")
        ns = net.members["a"].netns
        net_faults.cut(ns, [["-o", "eth0", "-d", net.members["b"].addr, "-j", "DROP"]])
        assert any(net_faults.CHAIN in r for r in net_faults.rules_in(ns))
        with pytest.raises(OSError):
            _connect(net, "a", "b", timeout=0.5)
        _echo_server(net, "c")
        _connect(net, "a", "c").close()          # the other peer is still reachable
        assert net_faults.uncut(ns) == []
        _connect(net, "a", "b").close()
    assert net.leftover() == []


@needs_iptables
def test_the_delayer_holds_what_the_node_sends_and_releases_it_on_heal():
    with netlab.network() as net:
        net.add("a")
        net.add("b")
        _echo_server(net, "b")
        ns = net.members["a"].netns
        with _connect(net, "a", "b") as conn:
            before = _rtt_ms(conn)
            delayer = net_faults.Delayer(ns, 7, delay_s=0.1, loss=0.0, seed=1)
            delayer.start()
            assert delayer.ready.wait(5) and delayer.error is None
            net_faults.cut(ns, [["-o", "eth0", "-j", "NFQUEUE", "--queue-num", "7", "--queue-bypass"]])
            during = _rtt_ms(conn)
            assert net_faults.uncut(ns) == []
            counts = delayer.stop()
            after = _rtt_ms(conn)
        assert before < 20 and 95 <= during < 300 and after < 20, (before, during, after)
        assert counts["held"] >= 15 and counts["dropped"] == 0


def test_the_packet_ids_of_a_queue_message_are_read():
    hdr = net_faults._attr(net_faults._ATTR_PACKET_HDR, (42).to_bytes(4, "big") + b"\x08\x00\x03")
    other = net_faults._attr(9, b"abcd")
    msg = net_faults._message(net_faults._MSG_PACKET, 7, other + hdr, 1)
    assert net_faults._packet_ids(msg + msg) == [42, 42]
    assert net_faults._packet_ids(b"") == []


@pytest.mark.process
def test_a_cluster_on_its_own_network_runs_etcd_in_a_namespace_and_leaves_nothing(tmp_path):
    from elasticd.lab.local_cluster import local_cluster

    with pytest.raises(RuntimeError, match="boom"), local_cluster(tmp_path, network=True) as cluster:
        assert cluster.endpoint.startswith(netlab.ETCD_HOST + ":")
        assert cluster.etcd.healthy()              # asked from inside its namespace
        tag = cluster.net.tag
        raise RuntimeError("boom")
    assert cluster.leftover == [] and not any(tag in n for n in netlab.namespaces())
    assert cluster.etcd.proc is None


def test_no_process_left_bites_on_a_namespace_the_cleanup_failed_to_delete(tmp_path, monkeypatch):
    """The cleanup weakened (namespace deletion made a no-op): the cluster reports the
    namespaces it could not remove, and the run's no-process-left check fails on them."""
    from elasticd.lab.chaos import invariants as inv
    from elasticd.lab.chaos.run import RUN, RunResult
    from elasticd.lab.chaos.scenario import FaultSpec, Scenario
    from elasticd.lab.local_cluster import local_cluster

    real = netlab.run
    monkeypatch.setattr(netlab, "run", lambda *cmd, check=True: real("true") if cmd[:3] == (
        "ip", "netns", "del") else real(*cmd, check=check))
    try:
        with local_cluster(tmp_path, etcd=False, network=True) as cluster:
            cluster.net.add("a")
        assert sorted(cluster.leftover) == sorted(f"netns {cluster.net.ns(m)}" for m in ("a", "sw"))
        sc = Scenario(1, (FaultSpec("partition-peers", "a", 5),), nodes=3, final_step=10)
        result = RunResult(sc, tmp_path, RUN, [], 0, 0, 1, {}, {}, {}, cluster.leftover)
        check = inv.check_processes(result)
        assert not check.passed and cluster.net.ns("a") in check.detail
    finally:
        monkeypatch.undo()
        netlab.sweep_stale()
        for name in [n for n in netlab.namespaces() if cluster.net.tag in n]:
            netlab.run("ip", "netns", "del", name)
    assert not any(cluster.net.tag in n for n in netlab.namespaces())
