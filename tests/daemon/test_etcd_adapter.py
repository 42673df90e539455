"""The etcd adapter's own contracts, against a real etcd.

- re-authentication after an etcd restart happens in place: threads sharing the client
  never see "Cannot invoke RPC on closed channel" (the old code closed the client
  under them);
- ``https://`` endpoints need a CA (they were stripped and used in plaintext);
- the checkpoint scan runs in its own thread, so a stalled (NFS) directory cannot
  stall the loop.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from structlog.testing import capture_logs

from elasticd import proctree
from elasticd.errors import ConfigError, EtcdError, EtcdUnavailable
from elasticd.etcd_client import EtcdClient, EtcdSettings, no_retry
from elasticd.observer import CheckpointScanner


@pytest.mark.process
def test_threads_sharing_a_client_survive_reauthentication(auth_etcd):
    client = EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root",
                                     password="rootpw", retry_s=20.0))
    client.put("/elasticd/reauth", b"0")
    stop = threading.Event()
    foreign: list[BaseException] = []
    ok_after: dict[int, int] = {}
    restarted = threading.Event()

    def work(i: int) -> None:
        while not stop.is_set():
            try:
                client.put(f"/elasticd/reauth-{i}", b"x")
                client.get("/elasticd/reauth")
                if restarted.is_set():
                    ok_after[i] = ok_after.get(i, 0) + 1
            except EtcdError:
                pass                  # translated: the caller's business, and fine
            except BaseException as exc:  # anything else escaped the adapter
                foreign.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        auth_etcd.restart(timeout_s=60)       # every simple-auth token is now invalid
        restarted.set()
        assert proctree.wait_for(lambda: len(ok_after) == 4 and min(ok_after.values()) >= 5, 30)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        client.close()
    assert not foreign, [repr(e) for e in foreign[:3]]


@pytest.mark.process
def test_reauthentication_keeps_the_channel_other_threads_hold(auth_etcd):
    client = EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root", password="rootpw"))
    try:
        held = client._client          # what another thread holds in the middle of a call
        client._authenticate()
        assert client._client is held
        held.get("/elasticd/held")     # a closed channel would raise ValueError here
    finally:
        client.close()


@pytest.mark.process
def test_a_password_over_plaintext_draws_a_warning(auth_etcd):
    with capture_logs() as logs:
        client = EtcdClient(EtcdSettings(endpoints=(auth_etcd.endpoint,), user="root",
                                         password="rootpw"))
    client.close()
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert any("over plaintext" in e["event"] for e in warnings), logs
    assert not any("rootpw" in str(e) for e in logs)


def test_a_call_on_a_closed_channel_is_translated(etcd_server):
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    client.close()
    with no_retry(), pytest.raises(EtcdUnavailable):
        client.get("/elasticd/closed")


def test_an_https_endpoint_needs_a_ca():
    with pytest.raises(ConfigError, match="asks for TLS but ca_cert is not set"):
        EtcdSettings(endpoints=("https://10.0.0.1:2379",))
    with pytest.raises(ConfigError, match="has a path"):
        EtcdSettings(endpoints=("10.0.0.1:2379/v3",))


def test_an_http_endpoint_with_a_ca_is_a_contradiction(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ConfigError, match="says plaintext but ca_cert is set"):
        EtcdSettings(endpoints=("http://10.0.0.1:2379",), ca_cert=str(ca))
    EtcdSettings(endpoints=("https://10.0.0.1:2379", "10.0.0.2:2379"), ca_cert=str(ca))


def test_a_stalled_checkpoint_scan_never_blocks_its_reader():
    release = threading.Event()

    def stalled_scan(directory: str) -> int:
        release.wait(30)               # a hard NFS mount failing over
        return 40

    scanner = CheckpointScanner("/nowhere", every_s=0.05, scan=stalled_scan).start()
    try:
        start = time.monotonic()
        for _ in range(20):
            assert scanner.step is None
            scanner.poke()
        assert time.monotonic() - start < 0.1
        release.set()
        assert proctree.wait_for(lambda: scanner.step == 40, 5)
    finally:
        release.set()
        scanner.stop()


def test_get_many_reads_more_keys_than_one_transaction_may_hold(etcd_server):
    # etcd refuses a transaction of more than 128 operations (--max-txn-ops); torch's
    # rank assignment multi_gets one key per agent: 256 agents broke it.
    from elasticd.etcd_client import MAX_TXN_OPS
    from tests.conftest import connect

    c = connect(etcd_server)
    keys = [f"/many-{i:04d}" for i in range(2 * MAX_TXN_OPS + 7)]
    for key in keys[::2]:
        c.put(key, key.encode())
    found, revision = c.get_many(keys)
    assert set(found) == set(keys[::2]) and revision > 0
    assert all(found[k].value == k.encode() for k in found)
    c.close()


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(("code", "details", "expected"), [
    (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader", EtcdUnavailable),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", EtcdUnavailable),
    # A member that lost quorum times its own proposal out (CI, 2 of 3 members down).
    (grpc.StatusCode.UNKNOWN, "context deadline exceeded", EtcdUnavailable),
    (grpc.StatusCode.UNKNOWN, "something else", EtcdError),
    (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided", EtcdError),
])
def test_rpc_errors_are_translated_by_what_they_mean(code, details, expected):
    client = EtcdClient(EtcdSettings(endpoints=("127.0.0.1:1",)))
    translated = client._translate_rpc(_RpcError(code, details))
    assert type(translated) is expected
