"""A private network for a local cluster: one network namespace per member (each node,
etcd), all linked by veth pairs to a bridge that lives in a namespace of its own.

Nothing of the machine's own network is touched: every namespace, veth and bridge is
created here, inside namespaces created here (``ip -n <switch> link add ... peer ... netns
<member>``: the pair is made in the switch namespace and one end moved straight into the
member's, so neither end ever exists in the machine's namespace), and deleting a
namespace removes its links, addresses, qdiscs and iptables rules with it. The members
talk over ``10.77.0.0/24`` (node ``k``: ``10.77.0.<k+1>``, etcd ``10.77.0.100``), which no
route of the machine knows: the namespaces have no link to the outside at all.

Names: ``eldnet-<tag>-<member>``, where the tag starts with the creating process's pid,
so that ``sweep_stale`` can remove what a crashed run left (a namespace whose creator is
dead) without touching a live run's, and never anything not named by this module.

A process joins a member's namespace by its command's prefix (``nsenter --net=...``:
only the network namespace changes; pid, mounts and environment are the caller's); the
harness itself reaches a member from a short-lived thread that entered it (``call_in``:
``setns`` changes only the calling thread's namespace).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

PREFIX = "eldnet"
SUBNET = ipaddress.ip_network("10.77.0.0/24")
ETCD_HOST = "10.77.0.100"
NETNS_DIR = "/run/netns"
_NAME = re.compile(rf"^{PREFIX}-(\d+)x[0-9a-f]+-[a-z0-9-]+$")
_CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetError(RuntimeError):
    """A network command failed; the message has the command and what it printed."""


def available() -> str | None:
    """None if namespaces can be made here, else why not (not root, no iproute2/nsenter)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [t for t in ("ip", "nsenter") if shutil.which(t) is None]
    return f"missing {', '.join(missing)}" if missing else None


def iptables_available() -> str | None:
    """None if iptables can be used inside the namespaces, else why not."""
    return None if shutil.which("iptables") else "iptables is not installed (apt-get install iptables)"


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one network command; ``NetError`` (with its output) if it fails and ``check``."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise NetError(f"{' '.join(cmd)}: exit {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out


def namespaces() -> list[str]:
    """The names of every namespace of this module on the machine (any run's)."""
    listed = run("ip", "netns", "list", check=False).stdout.splitlines()
    return [n for line in listed if _NAME.match(n := line.split()[0] if line.split() else "")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces a dead process of this module left (a crashed run);
    returns their names. A live run's (its creator still alive) are left alone."""
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def call_in(netns: str, fn: Callable[[], T]) -> T:
    """``fn()`` run in a thread that entered ``netns``'s network namespace first: its
    sockets are made there (a socket stays in the namespace it was made in)."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"{NETNS_DIR}/{netns}") as f:
                if libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns})")
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@dataclass
class Member:
    """One namespace on the switch: its name, its address, its veth's switch end."""

    name: str
    netns: str
    addr: str
    port: str   # the veth end on the bridge (in the switch namespace)


@dataclass
class Network:
    """The switch and its members; use ``network()``, which removes it all."""

    tag: str = field(default_factory=lambda: f"{os.getpid()}x{uuid.uuid4().hex[:4]}")
    members: dict[str, Member] = field(default_factory=dict)

    def ns(self, member: str) -> str:
        return f"{PREFIX}-{self.tag}-{member}"

    @property
    def switch(self) -> str:
        return self.ns("sw")

    def open(self) -> Network:
        sweep_stale()
        run("ip", "netns", "add", self.switch)
        self._ip(self.switch, "link", "set", "lo", "up")
        self._ip(self.switch, "link", "add", "br0", "type", "bridge")
        self._ip(self.switch, "link", "set", "br0", "up")
        return self

    @staticmethod
    def _ip(netns: str, *args: str) -> None:
        run("ip", "-n", netns, *args)

    def add(self, name: str, addr: str | None = None) -> Member:
        """A member namespace linked to the bridge; its address is ``addr`` or the next free."""
        if name in self.members or not re.fullmatch(r"[a-z0-9]{1,8}", name) or name == "sw":
            raise NetError(f"member name {name!r}: 1-8 of [a-z0-9], not 'sw', once")
        used = {m.addr for m in self.members.values()} | {ETCD_HOST}
        addr = addr or next(str(h) for h in SUBNET.hosts() if str(h) not in used)
        netns, port = self.ns(name), f"v-{name}"
        run("ip", "netns", "add", netns)
        self.members[name] = Member(name, netns, addr, port)
        self._ip(self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        self._ip(self.switch, "link", "set", port, "master", "br0", "up")
        self._ip(netns, "link", "set", "lo", "up")
        self._ip(netns, "addr", "add", f"{addr}/{SUBNET.prefixlen}", "dev", "eth0")
        self._ip(netns, "link", "set", "eth0", "up")
        return self.members[name]

    def prefix(self, member: str) -> list[str]:
        """The command prefix that runs a program in ``member``'s network namespace."""
        return ["nsenter", f"--net={NETNS_DIR}/{self.members[member].netns}", "--"]

    def close(self) -> list[str]:
        """Delete every namespace of this network (members first, the switch last);
        returns those still there after it (should be none)."""
        for member in [*self.members.values()]:
            run("ip", "netns", "del", member.netns, check=False)
        run("ip", "netns", "del", self.switch, check=False)
        self.members.clear()
        return self.leftover()

    def leftover(self) -> list[str]:
        """This network's namespaces still on the machine."""
        return [n for n in namespaces() if n.startswith(f"{PREFIX}-{self.tag}-")]


@contextlib.contextmanager
def network() -> Iterator[Network]:
    """A ``Network`` (stale ones of crashed runs swept first) removed whole on exit,
    however the block ends."""
    net = Network()
    try:
        yield net.open()
    finally:
        net.close()
