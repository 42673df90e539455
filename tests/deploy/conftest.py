"""Shared helpers for the deploy/ tests: paths, env files, certificates, example configs."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticd.lab.embedded_etcd import read_env_file  # noqa: F401 - the deploy tests' import

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CONFIGS = sorted((DEPLOY / "config").glob("*.toml"))
# Where the example configs expect the CA and client certificate on a node.
NODE_TLS_DIR = "/etc/elasticd/tls/"


def make_certs(out: Path, *names: str) -> Path:
    subprocess.run(["bash", str(DEPLOY / "etcd/make-certs.sh"), str(out), *names],
                   check=True, capture_output=True, timeout=60)
    return out


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Path:
    """A CA, a server cert for 127.0.0.1 and the elasticd client cert, from make-certs.sh."""
    return make_certs(tmp_path_factory.mktemp("certs"))


def node_copy(config: Path, tls_dir: Path, dest_dir: Path) -> Path:
    """``config`` as it would be on a node whose /etc/elasticd/tls is ``tls_dir``.

    load_config checks that the TLS files exist, and the tests cannot write /etc: the
    copy differs from the example only in that directory prefix.
    """
    text = config.read_text().replace(NODE_TLS_DIR, f"{tls_dir}/")
    dest = dest_dir / config.name
    dest.write_text(text)
    return dest


class NotifySocket:
    """systemd's side of ``NOTIFY_SOCKET``: a datagram socket at ``path`` that keeps every
    message a daemon sends (``READY=1``, ``STATUS=...``) in ``received``."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.received: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.2)

    def until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Receive until ``predicate()`` holds (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                self.received.append(self._sock.recv(4096).decode())
            if predicate():
                return True
        return False

    def close(self) -> None:
        self._sock.close()
