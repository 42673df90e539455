"""Clear errors for bad input, and the TLS and auth paths against real etcd servers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elasticd.embedded_etcd import EmbeddedEtcd, free_port
from elasticd.errors import ConfigError, EtcdAuthError, EtcdUnavailable
from elasticd.etcd_client import EtcdClient, EtcdSettings
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


def test_auth_failure_is_an_auth_error(auth_etcd):
    with pytest.raises(EtcdAuthError, match="rejected the credentials"):
        EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root", password="wrong"))


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


def test_tls_with_client_certificate(tls_etcd, certs):
    client = EtcdClient(EtcdSettings(endpoints=(tls_etcd.endpoint,), ca_cert=str(certs / "ca.pem"),
                                     cert=str(certs / "client.pem"), key=str(certs / "client-key.pem")))
    client.put("/elasticd/tls-test", b"secure")
    assert client.get("/elasticd/tls-test").value == b"secure"
    client.close()


def test_tls_without_client_certificate_is_refused(tls_etcd, certs):
    with pytest.raises(EtcdUnavailable, match=tls_etcd.endpoint):
        client = EtcdClient(EtcdSettings(endpoints=(tls_etcd.endpoint,), ca_cert=str(certs / "ca.pem"),
                                         timeout_s=1, retry_s=1))
        client.put("/elasticd/tls-test", b"x")


def test_garbage_tls_file_is_refused(tls_etcd, tmp_path):
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate")
    with pytest.raises(EtcdUnavailable):
        client = EtcdClient(EtcdSettings(endpoints=(tls_etcd.endpoint,), ca_cert=str(bogus),
                                         timeout_s=1, retry_s=1))
        client.put("/elasticd/tls-test", b"x")


def test_entry_point_registers_etcd3_with_torchrun():
    code = ("from torch.distributed.elastic.rendezvous.registry import _register_out_of_tree_handlers;"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
            "_register_out_of_tree_handlers(); print(r._registry['etcd3'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "create_handler" in out.stdout


def test_importing_the_handler_module_first_registers_the_plugin_without_an_error():
    """torch's registry calls the entry point while the handler module is half-imported
    (it imports torch's rendezvous): the entry point must not import it back then."""
    code = ("import elasticd.rendezvous.handler;"
            "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r;"
            "print(r._registry['etcd3'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "create_handler" in out.stdout
    assert "Exception while registering" not in out.stderr and "ImportError" not in out.stderr
