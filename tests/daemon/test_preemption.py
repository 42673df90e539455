"""Preemption watchers against a fake metadata service on 127.0.0.1 (elasticd/lab/fake_metadata.py).

The fake rejects requests the real services would reject (missing headers, no
or stale AWS token), so "no rejections" below proves the client's protocol.
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request

import pytest
from structlog.testing import capture_logs

from elasticd.errors import ConfigError, ElasticdError
from elasticd.lab.fake_metadata import FakeMetadata
from elasticd.preemption import (
    AwsProvider,
    AzureProvider,
    GceProvider,
    Notice,
    PreemptionConfig,
    PreemptionWatcher,
)

PROVIDERS = ["gce", "aws", "azure"]
INTERVAL_S = 0.1


@pytest.fixture
def fake():
    with FakeMetadata() as server:
        yield server


class Calls:
    """An ``on_notice`` that records its calls."""

    def __init__(self) -> None:
        self.notices: list[Notice] = []
        self.event = threading.Event()

    def __call__(self, notice: Notice) -> None:
        self.notices.append(notice)
        self.event.set()


def _config(fake: FakeMetadata, *providers: str, **kw) -> PreemptionConfig:
    kw.setdefault("poll_interval_s", INTERVAL_S)
    kw.setdefault("timeout_s", 0.5)
    return PreemptionConfig(metadata_url=fake.url, **{p: True for p in providers}, **kw)


def _announce(fake: FakeMetadata, provider: str) -> None:
    {"gce": fake.announce_gce, "aws": fake.announce_aws, "azure": fake.announce_azure}[provider]()


def _warnings(logs: list[dict], text: str) -> list[dict]:
    return [e for e in logs if text in e["event"]]


# -- configuration ------------------------------------------------------------------------------

def test_config_defaults():
    assert not PreemptionConfig().enabled
    assert PreemptionConfig(azure=True).enabled
    cfg = PreemptionConfig(gce=True, metadata_url="http://127.0.0.1:8123/")
    assert cfg.base_url("http://metadata.google.internal") == "http://127.0.0.1:8123"
    assert PreemptionConfig().base_url("http://169.254.169.254") == "http://169.254.169.254"


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"poll_interval_s": 0}, "poll_interval_s"),
    ({"poll_interval_s": -1.0}, "poll_interval_s"),
    ({"poll_interval_s": float("nan")}, "poll_interval_s"),
    ({"poll_interval_s": float("inf")}, "poll_interval_s"),
    ({"poll_interval_s": "1"}, "poll_interval_s"),
    ({"poll_interval_s": True}, "poll_interval_s"),
    ({"poll_interval_s": 60}, "poll_interval_s"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"metadata_url": "https://169.254.169.254"}, "metadata_url"),
    ({"metadata_url": "169.254.169.254"}, "metadata_url"),
    ({"metadata_url": "http://"}, "metadata_url"),
    ({"gce": "false"}, "gce"),
    ({"aws": 1}, "aws"),
])
def test_config_rejects(kwargs, key):
    with pytest.raises(ConfigError, match=key) as info:
        PreemptionConfig(**kwargs)
    assert isinstance(info.value, ElasticdError)
    assert "must" in str(info.value)  # the message says what a good value is


def test_aws_token_ttl_validated():
    with pytest.raises(ConfigError, match="token_ttl_s"):
        AwsProvider("http://127.0.0.1:1", token_ttl_s=21601)


# -- the fake enforces the real services' rules -------------------------------------------------

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _status(url: str, headers: dict | None = None, method: str = "GET") -> int:
    req = urllib.request.Request(url, headers=headers or {}, method=method,
                                 data=b"" if method == "PUT" else None)
    try:
        with _NO_PROXY.open(req, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def test_fake_rejects_clients_that_break_the_protocol(fake):
    assert _status(f"{fake.url}/computeMetadata/v1/instance/preempted") == 403
    assert _status(f"{fake.url}/computeMetadata/v1/instance/preempted",
                   {"Metadata-Flavor": "Google", "X-Forwarded-For": "1.2.3.4"}) == 403
    assert _status(f"{fake.url}/latest/meta-data/spot/instance-action") == 401
    assert _status(f"{fake.url}/latest/meta-data/spot/instance-action",
                   {"X-aws-ec2-metadata-token": "forged"}) == 401
    assert _status(f"{fake.url}/latest/api/token", method="PUT") == 400  # no TTL header
    assert _status(f"{fake.url}/latest/api/token") == 405  # IMDSv2 tokens are PUT only
    assert _status(f"{fake.url}/metadata/scheduledevents?api-version=2020-07-01") == 400
    assert _status(f"{fake.url}/metadata/scheduledevents", {"Metadata": "true"}) == 400


# -- quiet service, then a notice ---------------------------------------------------------------

def test_quiet_service_gives_no_notice(fake):
    calls = Calls()
    watcher = PreemptionWatcher(_config(fake, *PROVIDERS), calls)
    for _ in range(3):
        assert watcher.poll_once() is None
    assert calls.notices == []
    assert fake.rejections == []
    # One request per provider per poll, plus one AWS token: it is cached.
    assert fake.token_puts == 1
    assert len(fake.seen()) == 3 * 3 + 1


@pytest.mark.parametrize("provider", PROVIDERS)
def test_poll_once_delivers_each_providers_notice_once(fake, provider):
    calls = Calls()
    watcher = PreemptionWatcher(_config(fake, provider), calls)
    assert watcher.poll_once() is None
    _announce(fake, provider)
    notice = watcher.poll_once()
    assert notice is not None and notice.provider == provider
    assert calls.notices == [notice]
    seen = len(fake.seen())
    assert watcher.poll_once() is notice  # delivered: no more polls, no second callback
    assert calls.notices == [notice]
    assert len(fake.seen()) == seen
    assert fake.rejections == []


@pytest.mark.parametrize("provider", PROVIDERS)
def test_watcher_thread_detects_notice_within_two_intervals(fake, provider):
    calls = Calls()
    watcher = PreemptionWatcher(_config(fake, provider), calls).start()
    try:
        time.sleep(3 * INTERVAL_S)
        assert calls.notices == []
        _announce(fake, provider)
        announced = time.monotonic()
        assert calls.event.wait(5)
        elapsed = time.monotonic() - announced
        # One interval at most until the next poll, plus the poll itself and scheduling slack.
        assert elapsed < 2 * INTERVAL_S + 0.3, elapsed
        seen = len(fake.seen())
        time.sleep(3 * INTERVAL_S)
        assert len(calls.notices) == 1 and calls.notices[0].provider == provider
        assert len(fake.seen()) == seen, "the watcher kept polling after the notice"
        assert not watcher._thread.is_alive()
    finally:
        watcher.stop()
    assert fake.rejections == []


def test_stop_ends_polling(fake):
    watcher = PreemptionWatcher(_config(fake, "gce"), Calls()).start()
    time.sleep(2 * INTERVAL_S)
    watcher.stop()
    assert not watcher._thread.is_alive()
    seen = len(fake.seen())
    time.sleep(2 * INTERVAL_S)
    assert len(fake.seen()) == seen


def test_callback_may_stop_the_watcher_and_may_fail(fake):
    def on_notice(notice: Notice) -> None:
        watcher.stop()  # from the watcher's own thread: must not deadlock
        done.set()
        raise RuntimeError("drain failed")

    done = threading.Event()
    watcher = PreemptionWatcher(_config(fake, "gce"), on_notice)
    fake.announce_gce()
    with capture_logs() as logs:
        watcher.start()
        assert done.wait(5)
        watcher._thread.join(5)
    assert not watcher._thread.is_alive()
    assert watcher.notice is not None
    assert _warnings(logs, "on_notice callback failed")


def test_no_provider_enabled_starts_no_thread():
    watcher = PreemptionWatcher(PreemptionConfig(), Calls()).start()
    assert watcher._thread is None
    assert watcher.poll_once() is None
    watcher.stop()


# -- provider details ---------------------------------------------------------------------------

def test_gce_notice(fake):
    fake.announce_gce()
    notice = GceProvider(fake.url, timeout_s=1).check()
    assert notice == Notice("gce", "preempted", 30.0, "TRUE")


def test_aws_notice_deadline_from_time(fake):
    now = 1_700_000_000.0
    fake.announce_aws("stop", at=now + 120)
    notice = AwsProvider(fake.url, timeout_s=1, wall_clock=lambda: now).check()
    assert notice.provider == "aws" and notice.reason == "spot-stop"
    assert notice.deadline_s == pytest.approx(120.0)
    assert '"action": "stop"' in notice.raw


def test_aws_unparseable_200_is_still_a_notice(fake):
    fake.aws_action = "not json"
    notice = AwsProvider(fake.url, timeout_s=1).check()
    assert notice is not None and notice.deadline_s is None and notice.raw == "not json"


def test_aws_token_renewed_before_expiry(fake):
    now = [0.0]
    provider = AwsProvider(fake.url, timeout_s=1, token_ttl_s=100, clock=lambda: now[0])
    assert provider.check() is None
    now[0] = 80.0
    assert provider.check() is None
    assert fake.token_puts == 1
    now[0] = 91.0  # within the last tenth of the TTL: renew before the service expires it
    assert provider.check() is None
    assert fake.token_puts == 2
    assert fake.rejections == []


def test_aws_token_refetched_on_401(fake):
    provider = AwsProvider(fake.url, timeout_s=1)
    assert provider.check() is None
    fake.revoke_aws_tokens()
    fake.announce_aws()
    notice = provider.check()
    assert notice is not None and notice.provider == "aws"
    assert fake.token_puts == 2
    assert [r.status for r in fake.rejections] == [401]


def test_azure_notice_deadline_from_not_before(fake):
    now = 1_700_000_000.0
    event = fake.announce_azure("Preempt", not_before=now + 30)
    notice = AzureProvider(fake.url, timeout_s=1, wall_clock=lambda: now).check()
    assert notice.provider == "azure"
    assert notice.reason == f"preempt:{event['EventId']}"
    assert notice.deadline_s == pytest.approx(30.0)


def test_azure_started_event_has_zero_deadline(fake):
    fake.announce_azure("Terminate", not_before="")
    notice = AzureProvider(fake.url, timeout_s=1).check()
    assert notice.deadline_s == 0.0 and notice.reason.startswith("terminate:")


def test_azure_ignores_other_vms_and_other_event_types(fake):
    fake.announce_azure("Preempt", resources=["some-other-vm"])
    fake.announce_azure("Freeze")
    fake.announce_azure("Reboot")
    provider = AzureProvider(fake.url, timeout_s=1)
    assert provider.check() is None
    assert provider.vm_name() == fake.azure_vm_name
    fake.announce_azure("Preempt", resources=["some-other-vm", fake.azure_vm_name])
    assert provider.check() is not None
    assert len(fake.seen("/metadata/instance/compute/name")) == 1  # fetched once
    assert fake.rejections == []


# -- an absent, failing or slow service is never a notice ---------------------------------------

def test_server_down_is_no_notice_and_logged_once():
    fake = FakeMetadata().start()
    fake.stop()  # the port now refuses connections
    calls = Calls()
    watcher = PreemptionWatcher(_config(fake, *PROVIDERS), calls)
    with capture_logs() as logs:
        for _ in range(3):
            assert watcher.poll_once() is None
    assert calls.notices == []
    warned = _warnings(logs, "metadata unavailable")
    assert sorted(e["provider"] for e in warned) == sorted(PROVIDERS)


def test_errors_logged_once_per_state_change(fake):
    watcher = PreemptionWatcher(_config(fake, "gce"), Calls())
    with capture_logs() as logs:
        fake.fail_status = 500
        for _ in range(3):
            assert watcher.poll_once() is None
        fake.fail_status = None
        for _ in range(2):
            assert watcher.poll_once() is None
        fake.fail_status = 503
        assert watcher.poll_once() is None
    events = [e["event"] for e in logs]
    assert events == ["preemption metadata unavailable; still polling",
                      "preemption metadata reachable again",
                      "preemption metadata unavailable; still polling"]
    assert "HTTP 500" in logs[0]["error"]


def test_slow_service_times_out_without_notice(fake):
    fake.hang_s = 3.0
    watcher = PreemptionWatcher(_config(fake, "gce", timeout_s=0.2), Calls())
    started = time.monotonic()
    assert watcher.poll_once() is None
    assert time.monotonic() - started < 1.5


def test_environment_proxy_is_not_used(fake, monkeypatch):
    # A proxy would see (and could answer) metadata requests; port 9 on loopback refuses.
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    fake.announce_gce()
    assert GceProvider(fake.url, timeout_s=1).check() is not None
