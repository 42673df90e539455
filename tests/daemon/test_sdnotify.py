"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid

import pytest
from structlog.testing import capture_logs

from elasticd.errors import ConfigError
from elasticd.sdnotify import SystemdNotifier, WatchdogGate


class FakeSystemd:
    """The receiving end of NOTIFY_SOCKET: a bound SOCK_DGRAM socket."""

    def __init__(self, address: str, env_value: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.env_value = env_value

    def env(self, **extra: str) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.env_value, **extra}

    def received(self) -> list[bytes]:
        """Every datagram queued so far."""
        self.sock.setblocking(False)
        got = []
        while True:
            try:
                got.append(self.sock.recv(4096))
            except BlockingIOError:
                return got

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def systemd(tmp_path):
    path = str(tmp_path / "notify.sock")
    assert len(path) < 100, "AF_UNIX paths are limited to 107 bytes"
    fake = FakeSystemd(path, path)
    yield fake
    fake.close()


@pytest.fixture
def abstract_systemd():
    name = f"elasticd-test-{uuid.uuid4().hex}"
    fake = FakeSystemd("\0" + name, "@" + name)
    yield fake
    fake.close()


def test_helpers_send_exact_datagrams(systemd):
    notifier = SystemdNotifier(systemd.env())
    assert notifier.enabled
    assert notifier.ready()
    assert notifier.status("training: round 3, 2 nodes")
    assert notifier.watchdog()
    assert notifier.stopping()
    assert systemd.received() == [b"READY=1", b"STATUS=training: round 3, 2 nodes", b"WATCHDOG=1",
                                  b"STOPPING=1"]


def test_abstract_namespace_socket(abstract_systemd):
    notifier = SystemdNotifier(abstract_systemd.env())
    assert notifier.ready() and notifier.watchdog()
    assert abstract_systemd.received() == [b"READY=1", b"WATCHDOG=1"]


def test_reads_os_environ_by_default(systemd, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", systemd.env_value)
    assert SystemdNotifier().ready()
    assert systemd.received() == [b"READY=1"]


def test_status_is_one_line(systemd):
    notifier = SystemdNotifier(systemd.env())
    notifier.status("draining\nSTOPPING=1\r\n")
    assert systemd.received() == [b"STATUS=draining STOPPING=1"]


def test_notify_fields_in_one_datagram(systemd):
    notifier = SystemdNotifier(systemd.env())
    assert notifier.notify(READY=True, STATUS="up\nnow", MAINPID=42)
    assert notifier.send("ERRNO=5")
    assert systemd.received() == [b"READY=1\nSTATUS=up now\nMAINPID=42", b"ERRNO=5"]


def test_reloading_carries_monotonic_usec(systemd):
    notifier = SystemdNotifier(systemd.env())
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert notifier.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    [datagram] = systemd.received()
    match = re.fullmatch(rb"RELOADING=1\nMONOTONIC_USEC=(\d+)", datagram)
    assert match and before <= int(match.group(1)) <= after


def test_without_notify_socket_everything_is_a_noop(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    for notifier in (SystemdNotifier(), SystemdNotifier({}), SystemdNotifier({"NOTIFY_SOCKET": ""})):
        assert not notifier.enabled
        assert not notifier.ready()
        assert not notifier.status("x")
        assert not notifier.watchdog()
        assert not notifier.stopping()
        assert not notifier.reloading()
        assert notifier.watchdog_interval_s() is None
        assert WatchdogGate.for_notifier(notifier) is None


def test_unsupported_address_disables_notifications():
    with capture_logs() as logs:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled and not notifier.ready()
    assert [e["event"] for e in logs] == ["unsupported NOTIFY_SOCKET; notifications disabled"]


def test_socket_gone_is_logged_once_and_never_raised(tmp_path):
    path = str(tmp_path / "gone.sock")
    fake = FakeSystemd(path, path)
    notifier = SystemdNotifier(fake.env())
    assert notifier.ready()
    fake.close()
    os.unlink(path)
    with capture_logs() as logs:
        assert not notifier.watchdog()
        assert not notifier.watchdog()
        assert not notifier.status("still here")
    assert [e["event"] for e in logs] == ["systemd notify failed; continuing without it"]
    fake = FakeSystemd(path, path)  # systemd back (daemon-reexec): sends work again
    try:
        with capture_logs() as logs:
            assert notifier.watchdog()
        assert [e["event"] for e in logs] == ["systemd notify works again"]
        assert fake.received() == [b"WATCHDOG=1"]
    finally:
        fake.close()
        notifier.close()


@pytest.mark.parametrize(("extra", "interval"), [
    ({"WATCHDOG_USEC": "2000000"}, 2.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}, 2.0),
    ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "soon"}, None),
    ({"WATCHDOG_USEC": "0"}, None),
    ({}, None),
])
def test_watchdog_interval(systemd, extra, interval):
    notifier = SystemdNotifier(systemd.env(**extra))
    assert notifier.watchdog_interval_s() == interval
    assert notifier.watchdog_ping_period_s() == (None if interval is None else interval / 2)


# -- the watchdog gate --------------------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_gate_pings_only_while_the_loop_beats(systemd):
    clock = FakeClock()
    notifier = SystemdNotifier(systemd.env(WATCHDOG_USEC="10000000"))
    gate = WatchdogGate.for_notifier(notifier, clock=clock)
    assert gate.interval_s == 10.0 and gate.max_beat_age_s == 5.0
    assert gate.maybe_ping(notifier)  # construction counts as a beat
    clock.now += 4.0
    gate.beat()
    clock.now += 5.0
    assert gate.maybe_ping(notifier)  # beat exactly half an interval ago: still fine
    with capture_logs() as logs:
        clock.now += 0.5
        assert not gate.maybe_ping(notifier)  # the loop hung: withhold pings ...
        for _ in range(10):
            clock.now += 5.0
            assert not gate.maybe_ping(notifier)  # ... for as long as it stays hung
        gate.beat()
        assert gate.maybe_ping(notifier)
    assert [e["event"] for e in logs] == [
        "main loop stalled; withholding watchdog pings so systemd restarts us",
        "main loop beating again; watchdog pings resume"]
    assert systemd.received() == [b"WATCHDOG=1"] * 3


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10", True])
def test_gate_rejects_bad_interval(bad):
    with pytest.raises(ConfigError, match="interval_s"):
        WatchdogGate(bad)


@pytest.mark.process
def test_hung_main_loop_stops_pings_in_real_time(systemd):
    """A main loop beats in a thread, then hangs; pings stop within half an interval."""
    notifier = SystemdNotifier(systemd.env(WATCHDOG_USEC="400000"))  # 0.4 s
    gate = WatchdogGate.for_notifier(notifier)
    period = notifier.watchdog_ping_period_s()
    hang = threading.Event()
    release = threading.Event()
    hung_at: list[float] = []

    def main_loop() -> None:
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            gate.beat()
            time.sleep(0.02)
        hung_at.append(time.monotonic())
        hang.set()
        release.wait(5)  # wedged, as if blocked forever

    loop = threading.Thread(target=main_loop, daemon=True)
    loop.start()
    pings: list[float] = []
    try:
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            if gate.maybe_ping(notifier):
                pings.append(time.monotonic())
            time.sleep(period / 4)
    finally:
        release.set()
        loop.join(5)
    assert hang.is_set()
    before, after = [t for t in pings if t < hung_at[0]], [t for t in pings if t >= hung_at[0]]
    assert len(before) >= 3
    # Pings stop once the last beat is half an interval old; allow scheduling slack.
    assert all(t <= hung_at[0] + gate.max_beat_age_s + 0.1 for t in after), (after, hung_at)
    assert pings[-1] < end - notifier.watchdog_interval_s(), "systemd would not have fired"
    assert systemd.received() == [b"WATCHDOG=1"] * len(pings)
