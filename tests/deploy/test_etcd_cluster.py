"""A real 3-member etcd cluster on loopback, configured by deploy/etcd/cluster.sh (TLS for
clients and peers, each with its own CA, client-certificate auth) and secured by
deploy/etcd/setup-auth.sh (one user and role per job), then used the way elasticd uses it:
through EtcdClient with the job's user.

Members listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (the whole 127/8 is loopback on
Linux) with ports from free_port(); every etcd started here is killed at module teardown.
The tests run in file order and share the cluster; the failover test runs last because it
kills a member.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import ssl
import stat
import subprocess
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd import proctree
from elasticd.errors import EtcdAuthError
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.journal import Journal
from elasticd.lab.embedded_etcd import EmbeddedEtcdCluster, find_etcd_binary, free_port
from elasticd.lease import LeaseKeeper
from elasticd.membership import Membership
from elasticd.rendezvous.backend import EtcdV3RendezvousBackend
from elasticd.rendezvous.handler import parse_params
from elasticd.rendezvous.keys import JobKeys
from elasticd.rendezvous.store import EtcdV3Store
from tests.deploy.conftest import DEPLOY

# A 3-member TLS cluster (6 s to start) whose tests build on one another (auth first).
pytestmark = pytest.mark.process

ROOT_PASSWORD = "root-secret"
PASSWORD = "elasticd-secret"
MEMBERS = ("m1", "m2", "m3")
JOB = "job-a"
USER = f"elasticd-{JOB}"


class Cluster(EmbeddedEtcdCluster):
    """The package's 3-member cluster, configured by cluster.sh's env files, with the
    deploy tests' tools: etcdctl, setup-auth.sh, a client as the job's user."""

    @property
    def tls(self) -> Path:
        return self.tls_dir

    def etcdctl(self, *args: str, endpoints: tuple[str, ...] | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [etcdctl_binary(), f"--endpoints={','.join(endpoints or self.endpoints)}",
             f"--cacert={self.tls}/ca.pem", f"--cert={self.tls}/client.pem",
             f"--key={self.tls}/client-key.pem", "--dial-timeout=2s", *args],
            capture_output=True, text=True, timeout=30, check=check,
            env={"ETCDCTL_API": "3", "PATH": os.environ.get("PATH", "")})

    def setup_auth(self, elasticd_password: str = PASSWORD, root_password: str = ROOT_PASSWORD,
                   job: str = JOB) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(DEPLOY / "etcd/setup-auth.sh"), ",".join(self.endpoints), str(self.tls), job],
            capture_output=True, text=True, timeout=60,
            env={"PATH": os.environ.get("PATH", ""), "ETCDCTL": etcdctl_binary(),
                 "ETCD_ROOT_PASSWORD": root_password, "ELASTICD_ETCD_PASSWORD": elasticd_password})

    def client(self, password: str | None = PASSWORD, user: str | None = USER,
               endpoints: tuple[str, ...] | None = None, retry_s: float = 10) -> EtcdClient:
        return EtcdClient(EtcdSettings(
            endpoints=endpoints or self.endpoints, ca_cert=str(self.tls / "ca.pem"),
            cert=str(self.tls / "client.pem"), key=str(self.tls / "client-key.pem"),
            user=user if password is not None else None, password=password, timeout_s=2,
            retry_s=retry_s))


def etcdctl_binary() -> str:
    return str(Path(find_etcd_binary()).with_name("etcdctl"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    out = tmp_path_factory.mktemp("etcd-cluster")
    specs = [f"{name}=127.0.0.{i}:{free_port()}:{free_port()}" for i, name in enumerate(MEMBERS, 1)]
    subprocess.run(["bash", str(DEPLOY / "etcd/cluster.sh"), str(out), *specs], check=True,
                   capture_output=True, timeout=60,
                   env={**os.environ, "ETCD_TLS_DIR": str(out / "tls"),
                        "ETCD_CLUSTER_TOKEN": "elasticd-test"})
    c = Cluster.from_env_files(out, MEMBERS, out / "tls")
    try:
        yield c.start(timeout_s=20)
    finally:
        c.kill()


@pytest.mark.slow
def test_cluster_sh_writes_tls_for_clients_and_peers(cluster):
    env = cluster.members[1].env
    tls = cluster.tls
    assert env["ETCD_NAME"] == "m2"
    assert env["ETCD_INITIAL_CLUSTER"] == ",".join(
        f"{m.name}={m.env['ETCD_INITIAL_ADVERTISE_PEER_URLS']}" for m in cluster.members)
    for key in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
                "ETCD_INITIAL_ADVERTISE_PEER_URLS"):
        assert all(url.startswith("https://") for url in env[key].split(",")), key
    assert env["ETCD_CERT_FILE"] == f"{tls}/server-127.0.0.2.pem"
    assert env["ETCD_PEER_CERT_FILE"] == f"{tls}/peer-127.0.0.2.pem"
    assert env["ETCD_TRUSTED_CA_FILE"] == f"{tls}/ca.pem"
    assert env["ETCD_PEER_TRUSTED_CA_FILE"] == f"{tls}/peer-ca.pem"
    assert env["ETCD_PEER_CERT_ALLOWED_CN"] == "elasticd-etcd-peer"
    assert env["ETCD_CLIENT_CERT_AUTH"] == env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert env["ETCD_AUTO_COMPACTION_RETENTION"]
    members = cluster.etcdctl("member", "list").stdout
    assert members.count("started") == 3, members


def test_a_client_without_a_certificate_is_refused(cluster):
    done = subprocess.run([etcdctl_binary(), f"--endpoints={cluster.endpoints[0]}",
                           f"--cacert={cluster.tls}/ca.pem", "--dial-timeout=1s",
                           "--command-timeout=1s", "get", "x"],
                          capture_output=True, text=True, timeout=30, env={"ETCDCTL_API": "3"})
    assert done.returncode != 0


def _tls_get(port_url: str, cert: str, key: str, path: str = "/version") -> bytes:
    """One HTTPS GET with this client certificate; the server is not verified (an attacker's view)."""
    host, port = port_url.removeprefix("https://").rsplit(":", 1)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(cert, key)
    with socket.create_connection((host, int(port)), timeout=15) as raw, \
            ctx.wrap_socket(raw, server_hostname=host) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        # Stop at the end of the body: a loaded server may keep the connection open a while.
        while not _complete(data) and (chunk := tls.recv(65536)):
            data += chunk
        return data


def _complete(response: bytes) -> bool:
    head, sep, body = response.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def _client_cert_for(tls: Path, out: Path, ip: str) -> tuple[str, str]:
    """A client certificate of the client CA whose SAN is the node's address (a per-node cert)."""
    ext = out / "ext"
    ext.write_text(f"subjectAltName=IP:{ip}\nextendedKeyUsage=clientAuth\n")
    key, csr, cert = out / "node-key.pem", out / "node.csr", out / "node.pem"
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=node-1",
                    "-keyout", str(key), "-out", str(csr)], check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(tls / "ca.pem"),
                    "-CAkey", str(tls / "ca-key.pem"), "-CAcreateserial", "-days", "2",
                    "-extfile", str(ext), "-out", str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def test_a_client_certificate_is_refused_on_the_peer_port(cluster, tmp_path):
    """A node's client certificate (readable by its agent and workers) cannot act as a peer.

    With one CA for both ports (before), a client certificate whose SAN matched the
    caller's address was answered as a peer (measured: 200 on /version); etcd's SAN
    check was all that stopped ``client.pem`` (SAN DNS:elasticd). Now the handshake fails.
    """
    member = cluster.members[0]
    peer_url = member.env["ETCD_INITIAL_ADVERTISE_PEER_URLS"]
    host = member.endpoint.rsplit(":", 1)[0]
    tls = cluster.tls
    # Control: a member's own peer certificate is answered on the peer port.
    answer = b""
    for _ in range(3):   # a member under load may take a while to answer its first request
        with contextlib.suppress(TimeoutError):
            answer = _tls_get(peer_url, f"{tls}/peer-{host}.pem", f"{tls}/peer-{host}-key.pem")
            break
    assert b" 200 " in answer.split(b"\r\n")[0] and b"etcdserver" in answer, answer[:200]
    for cert, key in ((f"{tls}/client.pem", f"{tls}/client-key.pem"),
                      _client_cert_for(tls, tmp_path, host),
                      (f"{tls}/server-{host}.pem", f"{tls}/server-{host}-key.pem")):
        # Under TLS 1.3 the server's alert arrives at the first read, inside _tls_get.
        with pytest.raises(ssl.SSLError, match="BAD_CERTIFICATE|UNKNOWN_CA|CERTIFICATE"):
            _tls_get(peer_url, cert, key)


def test_key_files_are_private(cluster):
    keys = sorted(cluster.tls.glob("*-key.pem"))
    assert any(k.name == "client-key.pem" for k in keys)
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key.name


def test_setup_auth_limits_each_job_to_its_prefix(cluster):
    done = cluster.setup_auth()
    assert done.returncode == 0, done.stderr
    other = cluster.setup_auth(elasticd_password="other-secret", job="job-b")
    assert other.returncode == 0, other.stderr
    assert "elasticd-job-b may read and write /elasticd/job-b/ only" in other.stdout
    client = cluster.client()
    b_client = cluster.client(user="elasticd-job-b", password="other-secret")
    try:
        client.put("/elasticd/job-a/state", b"running")
        assert client.get("/elasticd/job-a/state").value == b"running"
        b_client.put("/elasticd/job-b/state", b"running")
        for outside in ("/elasticd/job-b/state", "/elasticd/job-b/rdzv/state", "/elasticd/job-a-2/x",
                        "/elasticd/job-a", "/other", "/elasticd", "/elasticd-other/x", "/"):
            with pytest.raises(EtcdAuthError):
                client.put(outside, b"x")
        for outside in ("/elasticd/job-b/state", "/other"):
            with pytest.raises(EtcdAuthError):
                client.get(outside)
        with pytest.raises(EtcdAuthError):
            client.get_prefix("/elasticd/job-b/")
        with pytest.raises(EtcdAuthError):
            client.get_prefix("/elasticd/")
        with pytest.raises(EtcdAuthError):
            b_client.get("/elasticd/job-a/state")
    finally:
        client.close()
        b_client.close()
    with pytest.raises(EtcdAuthError):
        cluster.client(password="wrong", retry_s=0)
    roles = cluster.etcdctl("--user", f"root:{ROOT_PASSWORD}", "role", "get", USER).stdout
    assert "prefix /elasticd/job-a/" in roles and "job-b" not in roles, roles
    users = cluster.etcdctl("--user", f"root:{ROOT_PASSWORD}", "user", "list").stdout.split()
    assert "elasticd" not in users, "no user may match the client certificate's CN"


def test_setup_auth_refuses_a_bad_job_id(cluster):
    for bad in ("Job A", "../x", "-x", "a/b"):
        done = cluster.setup_auth(job=bad)
        assert done.returncode == 2 and f"job id '{bad}' is not valid" in done.stderr, done.stderr


def test_the_client_certificate_alone_grants_nothing(cluster):
    """client-cert-auth maps the certificate's CN to a user; no user has that name."""
    client = cluster.client(password=None, retry_s=0)
    try:
        for key in (f"/elasticd/{JOB}/cert-only", "/other"):
            with pytest.raises(EtcdAuthError):
                client.put(key, b"x")
        with pytest.raises(EtcdAuthError):
            client.get(f"/elasticd/{JOB}/state")
    finally:
        client.close()


def test_the_role_covers_what_the_daemon_and_the_plugin_do(cluster):
    """Leases, records on leases, watches, transactions, the store, revoking: all as elasticd."""
    client = cluster.client()
    keys = JobKeys(JOB)
    membership = Membership(client, keys, "node-a", 3, {"addr": "127.0.0.1"})
    lease = LeaseKeeper(client, 10, name="rdzv-test").start()
    try:
        membership.register()
        membership.poll()
        Journal(client, keys, "node-a").record("node-joined")
        assert client.get(keys.node("node-a")) is not None
        backend = EtcdV3RendezvousBackend(client, keys.rdzv_state, lease)
        round_1 = pickle.dumps(dyn._RendezvousState())
        state, token, won = backend.set_state(round_1)
        assert won and backend.get_state() == (round_1, token)
        store = EtcdV3Store(client, keys.store, lease)
        store.set("master", b"10.0.0.1:29500")
        assert store.get("master") == b"10.0.0.1:29500"
        assert store.add("count", 1) == 1
        membership.leave()
        assert client.get(keys.node("node-a")) is None
    finally:
        lease.stop(revoke=True)
        client.close()
    # The torchrun plugin builds its settings from --rdzv-conf; the same credentials work.
    settings = parse_params(RendezvousParameters(
        "etcd3", ",".join(cluster.endpoints), JOB, 1, 2, protocol="https",
        ca_cert=str(cluster.tls / "ca.pem"), ssl_cert=str(cluster.tls / "client.pem"),
        ssl_cert_key=str(cluster.tls / "client-key.pem"), user=USER, password=PASSWORD)).etcd
    plugin = EtcdClient(settings)
    try:
        assert plugin.get(keys.rdzv_state) is None   # its lease was revoked with the state
    finally:
        plugin.close()


def test_setup_auth_is_idempotent_and_rotates_the_password(cluster):
    done = cluster.setup_auth(elasticd_password="rotated")
    assert done.returncode == 0, done.stderr
    with pytest.raises(EtcdAuthError):
        cluster.client(retry_s=0)
    client = cluster.client(password="rotated")
    client.put(f"/elasticd/{JOB}/rotated", b"1")
    client.close()
    wrong_root = cluster.setup_auth(root_password="wrong")
    assert wrong_root.returncode != 0 and "cannot act as root" in wrong_root.stderr
    assert cluster.setup_auth().returncode == 0   # back to PASSWORD


FAILOVER_KEY = f"/elasticd/{JOB}/failover"


def test_failover_when_a_member_dies(cluster):
    client = cluster.client()
    # python-etcd3 starts on a random endpoint: kill the one this client is talking to.
    in_use = client._client.endpoint_in_use.netloc
    first = next(m for m in cluster.members if m.endpoint == in_use)
    try:
        client.put(FAILOVER_KEY, b"before")
        cluster.kill(first)
        client.put(FAILOVER_KEY, b"after")
        assert client.get(FAILOVER_KEY).value == b"after"
        # The restarted member rejoins from its data dir (the env file's initial-cluster
        # settings are ignored then) and has the write it missed.
        cluster.start([first])
        alone = cluster.client(endpoints=(first.endpoint,))
        try:
            assert proctree.wait_for(
                lambda: (alone.get(FAILOVER_KEY) or None) is not None
                and alone.get(FAILOVER_KEY).value == b"after", 10, 0.1)
        finally:
            alone.close()
    finally:
        client.close()
        cluster.kill(first)   # started by this test: the leak check wants it gone before teardown
