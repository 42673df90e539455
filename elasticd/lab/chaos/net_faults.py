"""Network faults: one node's links cut (from etcd, from its peers, one way) or slowed
(delay and loss), then healed.

They need the cluster on its own network (``local_cluster(network=True)``, chosen by the
runner when a scenario has a fault whose class says ``network = True``): every node and
the etcd in a namespace of ``elasticd.lab.netlab``. A cut is a chain of iptables rules
(``ELDNET``) inside the victim's namespace only, hooked into its INPUT and OUTPUT; the
heal unhooks, flushes and deletes the chain, and checks that the namespace holds no rule
any more. Nothing outside the cluster's namespaces is touched, and deleting the
namespaces with the cluster removes whatever a crash left.

Delay and loss: ``tc qdisc ... netem`` on the victim's ``eth0`` where the kernel has netem;
this machine's kernel is built without it (CONFIG_NET_SCH_NETEM unset, no modules), so
the same effect, on the same packets (what leaves the node's ``eth0``), comes from an
iptables NFQUEUE rule and a delayer in the harness (``Delayer``): it holds each packet for
the delay and drops the asked share (its verdicts over nfnetlink, in the victim's
namespace). ``--queue-bypass``: if the delayer is gone, packets pass instead of dying.
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import random
import select
import socket
import struct
import threading
import time
from typing import ClassVar

from elasticd.lab import netlab
from elasticd.lab.chaos.faults import INJECTORS, Detail, InjectionError, Injector, Target
from elasticd.lab.local_cluster import DaemonNode

CHAIN = "ELDNET"


def netns_of(node: DaemonNode) -> str:
    """The network namespace a node runs in (from its command prefix)."""
    for arg in node.prefix:
        if arg.startswith(f"--net={netlab.NETNS_DIR}/"):
            return arg.rsplit("/", 1)[1]
    raise InjectionError(f"node {node.name} is not in a network namespace: run the scenario "
                         "on the cluster's own network (local_cluster(network=True))")


def _iptables(netns: str, *args: str, check: bool = True) -> None:
    try:
        netlab.run("ip", "netns", "exec", netns, "iptables", "-w", *args, check=check)
    except netlab.NetError as exc:
        raise InjectionError(str(exc)) from None


def rules_in(netns: str) -> list[str]:
    """iptables rules in a namespace (policies left out): empty after every heal."""
    out = netlab.run("ip", "netns", "exec", netns, "iptables", "-w", "-S").stdout.splitlines()
    return [line for line in out if not line.startswith("-P ")]


def cut(netns: str, rules: list[list[str]]) -> None:
    """The chain of ``rules`` (iptables rule specs without ``-A CHAIN``), hooked first
    into INPUT and OUTPUT of ``netns``."""
    _iptables(netns, "-N", CHAIN)
    for rule in rules:
        _iptables(netns, "-A", CHAIN, *rule)
    for hook in ("INPUT", "OUTPUT"):
        _iptables(netns, "-I", hook, "1", "-j", CHAIN)


def uncut(netns: str) -> list[str]:
    """Remove the chain (each step allowed to fail: a half-made cut is removed too);
    returns the rules left in the namespace (should be none)."""
    for hook in ("INPUT", "OUTPUT"):
        _iptables(netns, "-D", hook, "-j", CHAIN, check=False)
    _iptables(netns, "-F", CHAIN, check=False)
    _iptables(netns, "-X", CHAIN, check=False)
    return rules_in(netns)


class NetFault(Injector):
    """A fault on the victim's links for ``cut_s``, then healed. Training must go on in
    the survivors (or through the slowness) and a world of N come back after the heal;
    whether the victim's workers are replaced depends on what the fault did to them."""

    network: ClassVar[bool] = True
    # Not in the command line's default draw: that is one scenario, and these need root,
    # iptables and a network of their own (no 3-member etcd, no metadata server there).
    drawn_by_default: ClassVar[bool] = False
    replaces_workers = False
    phases: ClassVar[tuple[str, ...]] = ("inject", "reform")
    lasts = True

    def cut_s(self, t: Target) -> float:
        return self.lasting(t.lease_ttl_s + 5.0)   # past the lease: the cut node's record is gone

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        raise NotImplementedError

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        netns = netns_of(victim)
        rules = self.rules(t, victim)
        try:
            cut(netns, rules)
        except InjectionError:
            uncut(netns)
            raise
        return {"netns": netns, "rules": [" ".join(r) for r in rules], "cut_s": self.cut_s(t),
                "addr": victim.config_kw.get("addr")}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        time.sleep(self.cut_s(t))
        return {"rules_left": uncut(netns_of(victim))}


def _etcd_host(t: Target) -> str:
    return t.etcd.host


def _peers_only(t: Target, *rules: list[str]) -> list[list[str]]:
    """``rules`` for everything but etcd: what goes to and comes from it passes first."""
    etcd = _etcd_host(t)
    return [["-o", "eth0", "-d", etcd, "-j", "RETURN"], ["-i", "eth0", "-s", etcd, "-j", "RETURN"],
            *rules]


class PartitionEtcd(NetFault):
    name = "partition-etcd"
    summary = "cut one node from etcd (both ways), its peers still reachable; heal after lease + 5 s"

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        etcd = _etcd_host(t)
        return [["-o", "eth0", "-d", etcd, "-j", "DROP"], ["-i", "eth0", "-s", etcd, "-j", "DROP"]]


class PartitionPeers(NetFault):
    name = "partition-peers"
    summary = "cut one node from its peers (both ways), etcd still reachable; heal after lease + 5 s"

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        return _peers_only(t, ["-o", "eth0", "-j", "DROP"], ["-i", "eth0", "-j", "DROP"])


class PartitionPeersReject(NetFault):
    name = "partition-peers-reject"
    summary = ("cut one node from its peers by rejecting (TCP resets, both ways), etcd still "
               "reachable; heal after lease + 5 s")

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        reset = ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"]
        return _peers_only(t, ["-o", "eth0", *reset], ["-i", "eth0", *reset],
                           ["-o", "eth0", "-j", "DROP"], ["-i", "eth0", "-j", "DROP"])


class PartitionPeersOneWay(NetFault):
    name = "partition-peers-oneway"
    summary = ("drop what the node sends to its peers (what they send still arrives), etcd "
               "still reachable both ways; heal after lease + 5 s")

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        return _peers_only(t, ["-o", "eth0", "-j", "DROP"])


class PartitionOneWay(NetFault):
    name = "partition-oneway"
    summary = "drop every packet the node sends (what is sent to it still arrives); heal after lease + 5 s"

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        return [["-o", "eth0", "-j", "DROP"]]


class PartitionOneWayIn(NetFault):
    name = "partition-oneway-in"
    summary = "drop every packet sent to the node (what it sends still leaves); heal after lease + 5 s"

    def rules(self, t: Target, victim: DaemonNode) -> list[list[str]]:
        return [["-i", "eth0", "-j", "DROP"]]


# -- delay and loss -----------------------------------------------------------------------

def has_netem(netns: str) -> bool:
    """Whether this kernel has the netem qdisc (tried on the namespace's loopback, which
    nothing uses, and removed at once)."""
    ok = netlab.run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                    "delay", "1ms", check=False).returncode == 0
    if ok:
        netlab.run("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    return ok


# nfnetlink queue (linux/netfilter/nfnetlink_queue.h)
_NETLINK_NETFILTER = 12
_NFNL_SUBSYS_QUEUE = 3
_MSG_PACKET, _MSG_VERDICT, _MSG_CONFIG = 0, 1, 2
_CFG_CMD, _CFG_PARAMS = 1, 2
_CMD_BIND, _CMD_UNBIND = 1, 2
_COPY_META = 1
_ATTR_PACKET_HDR, _ATTR_VERDICT_HDR = 1, 2
_NF_DROP, _NF_ACCEPT = 0, 1
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg: int, queue: int, attrs: bytes, seq: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (_NFNL_SUBSYS_QUEUE << 8) | msg, _NLM_F_REQUEST,
                       seq, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """The packet ids of the queued-packet messages in one netlink read."""
    ids, off = [], 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            break
        if kind == (_NFNL_SUBSYS_QUEUE << 8) | _MSG_PACKET:
            pos, end = off + 20, off + length
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if atype & 0x7FFF == _ATTR_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += (alen + 3) & ~3
        off += (length + 3) & ~3
    return ids


class Delayer(threading.Thread):
    """Holds each packet of NFQUEUE ``queue`` in ``netns`` for ``delay_s`` and drops
    ``loss`` of them (a seeded draw), as netem on that hook would; ``stop`` releases
    what it holds (accepted) and unbinds."""

    def __init__(self, netns: str, queue: int, delay_s: float, loss: float, seed: int) -> None:
        super().__init__(name=f"delayer-{netns}", daemon=True)
        self.netns, self.queue, self.delay_s, self.loss = netns, queue, delay_s, loss
        self.rng = random.Random(seed)
        self.counts = {"held": 0, "dropped": 0}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._seq = 0

    def _send(self, sock: socket.socket, msg: int, attrs: bytes) -> None:
        self._seq += 1
        sock.send(_message(msg, self.queue, attrs, self._seq))

    def _verdict(self, sock: socket.socket, packet_id: int, verdict: int) -> None:
        self._send(sock, _MSG_VERDICT, _attr(_ATTR_VERDICT_HDR, struct.pack("!II", verdict, packet_id)))

    def run(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"{netlab.NETNS_DIR}/{self.netns}") as f:
                if libc.setns(f.fileno(), 0x40000000) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({self.netns})")
            with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_NETFILTER) as sock:
                sock.bind((0, 0))
                self._send(sock, _MSG_CONFIG, _attr(_CFG_CMD, struct.pack("!BBH", _CMD_BIND, 0,
                                                                          socket.AF_INET)))
                self._send(sock, _MSG_CONFIG, _attr(_CFG_PARAMS, struct.pack("!IB", 0, _COPY_META)))
                self.ready.set()
                self._loop(sock)
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc
            self.ready.set()

    def _loop(self, sock: socket.socket) -> None:
        held: list[tuple[float, int]] = []
        while not self._halt.is_set():
            wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.05
            if select.select([sock], [], [], min(wait, 0.05))[0]:
                for packet_id in _packet_ids(sock.recv(1 << 16)):
                    if self.rng.random() < self.loss:
                        self.counts["dropped"] += 1
                        self._verdict(sock, packet_id, _NF_DROP)
                    else:
                        self.counts["held"] += 1
                        heapq.heappush(held, (time.monotonic() + self.delay_s, packet_id))
            while held and held[0][0] <= time.monotonic():
                self._verdict(sock, heapq.heappop(held)[1], _NF_ACCEPT)
        for _, packet_id in held:   # the heal: what is held goes on at once
            self._verdict(sock, packet_id, _NF_ACCEPT)
        with contextlib.suppress(OSError):
            self._send(sock, _MSG_CONFIG, _attr(_CFG_CMD, struct.pack("!BBH", _CMD_UNBIND, 0,
                                                                      socket.AF_INET)))

    def stop(self) -> dict[str, int]:
        self._halt.set()
        self.join(timeout=5)
        if self.error is not None:
            raise InjectionError(f"delayer in {self.netns}: {self.error}")
        return dict(self.counts)


class Netem(NetFault):
    """100 ms delay and 5% loss on what the node sends, for 20 s: slower steps, no
    eviction (the lease's keep-alives get through), no restart."""

    name = "netem"
    summary = "100 ms delay and 5% loss on everything the node sends, for 20 s"
    DELAY_S = 0.1
    LOSS = 0.05
    HOLD_S = 20.0
    QUEUE = 7
    SEED = 5     # the drop draws: the same sequence every run

    def cut_s(self, t: Target) -> float:
        return self.lasting(self.HOLD_S)

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        netns = netns_of(victim)
        self._delayer: Delayer | None = None
        if has_netem(netns):
            netlab.run("ip", "netns", "exec", netns, "tc", "qdisc", "add", "dev", "eth0", "root", "netem",
                       "delay", f"{self.DELAY_S * 1000:g}ms", "loss", f"{self.LOSS * 100:g}%")
            how = "tc netem"
        else:
            self._delayer = Delayer(netns, self.QUEUE, self.DELAY_S, self.LOSS, seed=self.SEED)
            self._delayer.start()
            self._delayer.ready.wait(5)
            if self._delayer.error is not None:
                raise InjectionError(f"delayer: {self._delayer.error}")
            try:
                cut(netns, [["-o", "eth0", "-j", "NFQUEUE", "--queue-num", str(self.QUEUE),
                             "--queue-bypass"]])
            except InjectionError:
                uncut(netns)
                self._delayer.stop()
                raise
            how = "nfqueue delayer (this kernel has no netem)"
        return {"netns": netns, "delay_ms": self.DELAY_S * 1000, "loss": self.LOSS, "how": how,
                "hold_s": self.HOLD_S}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        time.sleep(self.cut_s(t))
        netns = netns_of(victim)
        out: Detail = {}
        if self._delayer is None:
            netlab.run("ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            out["rules_left"] = rules_in(netns)
        else:
            out["rules_left"] = uncut(netns)
            out["packets"] = self._delayer.stop()
        out["qdiscs_left"] = [q for q in netlab.run("ip", "netns", "exec", netns, "tc", "qdisc", "show",
                                                    "dev", "eth0").stdout.splitlines() if "netem" in q]
        return out


NET_INJECTORS: tuple[type[Injector], ...] = (
    PartitionEtcd, PartitionPeers, PartitionPeersReject, PartitionPeersOneWay, PartitionOneWay,
    PartitionOneWayIn, Netem)
INJECTORS.update({cls.name: cls for cls in NET_INJECTORS})
