"""Clear errors for bad input, and the TLS and auth paths against real etcd servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.errors import ConfigError, EtcdAuthError, EtcdUnavailable
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.lab.embedded_etcd import EmbeddedEtcd, free_port
from elasticd.rendezvous.closed import DAEMON_PID_ENV, closed_message
from elasticd.rendezvous.handler import create_handler, parse_params

REPO = Path(__file__).resolve().parents[2]


def params(endpoint: str = "127.0.0.1:2379", **conf: str) -> RendezvousParameters:
    return RendezvousParameters("etcd3", endpoint, "job-1", 1, 2, **conf)


@pytest.mark.parametrize("conf, message", [
    ({"last_call_timeout": "abc"}, "last_call_timeout='abc' is not a whole number"),
    ({"join_timeout": "0"}, "join_timeout=0 must be >= 1"),
    ({"keep_alive_interval": "1", "keep_alive_max_attempt": "2"}, "split brain"),
    ({"protocol": "https"}, "needs ca_cert"),
    ({"protocol": "gopher"}, "use http or https"),
    ({"ca_cert": "/nonexistent/ca.pem", "protocol": "https"}, "no such file"),
    ({"ssl_cert": "/tmp/x.pem"}, "both cert and key"),
    ({"user": "root"}, "both user and password"),
    ({"key_prefix": "elasticd/"}, "must start with '/'"),
    ({"ttl": "-5"}, "ttl=-5 must be >= 1"),
])
def test_malformed_rdzv_conf_names_the_key_and_the_fix(conf, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_params(params(**conf))


@pytest.mark.parametrize("endpoint, message", [
    ("", "--rdzv-endpoint is empty"),
    ("127.0.0.1:99999", "bad port"),
])
def test_bad_endpoint(endpoint, message):
    with pytest.raises(ConfigError, match=message):
        parse_params(params(endpoint))


def test_bad_run_id():
    with pytest.raises(ConfigError, match="job id 'Has Space' is not valid"):
        parse_params(RendezvousParameters("etcd3", "127.0.0.1:2379", "Has Space", 1, 2))


def test_the_closed_error_names_the_etcdctl_command_with_the_agents_tls_and_user(tmp_path, monkeypatch):
    """The fix printed for a closed rendezvous is the command to run as is: this agent's
    endpoints (https for TLS), TLS files and user, never the password."""
    files = {name: tmp_path / f"{name}.pem" for name in ("ca", "cert", "key")}
    for path in files.values():
        path.write_text("x")
    config = parse_params(params("10.0.0.1:2379,10.0.0.2:2379", protocol="https", ttl="60",
                                 key_prefix="/train", ca_cert=str(files["ca"]),
                                 ssl_cert=str(files["cert"]), ssl_cert_key=str(files["key"]),
                                 user="alice", password="s3cret"))
    monkeypatch.delenv(DAEMON_PID_ENV, raising=False)
    text = closed_message("job-1", config.keys, config.etcd, config.ttl_s)
    assert text.startswith("the rendezvous of run 'job-1' is closed: a run with this id completed")
    assert "(--rdzv-conf ttl=60 s after that run's agents exited)" in text
    assert text.endswith(
        "Start the next run with a new --rdzv-id, or reuse this one after deleting its keys with "
        "every agent stopped: etcdctl --endpoints=https://10.0.0.1:2379,https://10.0.0.2:2379 "
        f"--cacert={files['ca']} --cert={files['cert']} --key={files['key']} --user=alice "
        "del --prefix /train/job-1/")
    assert "s3cret" not in text
    # Under the daemon the run id is its [job] id, and the daemons are what must stop.
    monkeypatch.setenv(DAEMON_PID_ENV, "1")
    text = closed_message("job-1", config.keys, config.etcd, config.ttl_s)
    assert "Start the next run with a new [job] id (or ELASTICD_JOB_ID)" in text
    assert "([rendezvous] ttl=60 s" in text and "with every daemon stopped: etcdctl" in text


@pytest.mark.process
def test_unreachable_etcd_names_every_endpoint_tried():
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with pytest.raises(EtcdUnavailable) as info:
        create_handler(params(",".join(dead), retry_timeout="1", read_timeout="1"))
    for endpoint in dead:
        assert endpoint in str(info.value)


def test_second_endpoint_is_used_when_the_first_is_down(etcd_server):
    client = EtcdClient(EtcdSettings(endpoints=(f"127.0.0.1:{free_port()}", etcd_server.endpoint),
                                     timeout_s=1, retry_s=10))
    client.put("/elasticd/failover-test", b"ok")
    assert client.get("/elasticd/failover-test").value == b"ok"
    client.close()


@pytest.mark.process
def test_auth_failure_is_an_auth_error(auth_etcd):
    with pytest.raises(EtcdAuthError, match="rejected the credentials"):
        EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root", password="wrong"))


@pytest.mark.process
def test_auth_success_and_anonymous_refused(auth_etcd):
    good = EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root", password="rootpw"))
    good.put("/elasticd/auth-test", b"v")
    assert good.get("/elasticd/auth-test").value == b"v"
    good.close()
    anonymous = EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), retry_s=0))
    with pytest.raises(EtcdAuthError):
        anonymous.put("/elasticd/auth-test", b"x")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(["bash", str(REPO / "deploy/etcd/make-certs.sh"), str(out), "127.0.0.1"],
                   check=True, capture_output=True)
    return out


@pytest.fixture
def tls_etcd(certs):
    server = EmbeddedEtcd(tls_dir=str(certs)).start()
    yield server
    server.stop()


@pytest.mark.process
def test_tls_with_client_certificate(tls_etcd, certs):
    client = EtcdClient(EtcdSettings(endpoints=(tls_etcd.endpoint,), ca_cert=str(certs / "ca.pem"),
                                     cert=str(certs / "client.pem"), key=str(certs / "client-key.pem")))
    client.put("/elasticd/tls-test", b"secure")
    assert client.get("/elasticd/tls-test").value == b"secure"
    client.close()


@pytest.mark.process
def test_tls_without_client_certificate_is_refused(tls_etcd, certs):
    with pytest.raises(EtcdUnavailable, match=tls_etcd.endpoint):
        client = EtcdClient(EtcdSettings(endpoints=(tls_etcd.endpoint,), ca_cert=str(certs / "ca.pem"),
                                         timeout_s=1, retry_s=1))
        client.put("/elasticd/tls-test", b"x")


@pytest.mark.process
def test_garbage_tls_file_is_refused(tls_etcd, tmp_path):
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(EtcdUnavailable):
        client = EtcdClient(EtcdSettings(endpoints=(tls_etcd.endpoint,), ca_cert=str(bogus),
                                         timeout_s=1, retry_s=1))
        client.put("/elasticd/tls-test", b"x")


@pytest.mark.slow
def test_entry_point_registers_etcd3_with_torchrun():
    code = ("from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers;"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
            "_register_out_of_tree_handlers(); print(r._registry['etcd3'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "create_handler" in out.stdout


@pytest.mark.process
def test_importing_the_handler_module_first_registers_the_plugin_without_an_error():
    """torch's registry calls the entry point while the handler module is half-imported
    (it imports torch's rendezvous): the entry point must not import it back then."""
    code = ("import elasticd.rendezvous.handler;"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
            "print(r._registry['etcd3'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "create_handler" in out.stdout
    assert "Exception while registering" not in out.stderr and "ImportError" not in out.stderr
