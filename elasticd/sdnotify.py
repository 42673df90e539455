"""The systemd notify protocol (sd_notify), without libsystemd.

systemd runs the daemon as ``Type=notify`` with ``WatchdogSec=``: it passes a
datagram socket in ``NOTIFY_SOCKET`` and expects ``READY=1`` once the daemon
serves, ``WATCHDOG=1`` at least every ``WATCHDOG_USEC`` microseconds (else it
kills and restarts the daemon), and ``STOPPING=1`` when it shuts down.

Contracts:

* Without ``NOTIFY_SOCKET`` (not under systemd) every call is a no-op returning False.
* A failed send (socket gone, queue full) returns False and is logged once per
  change of state; it is never raised: losing a notification must not stop the daemon.
* ``WatchdogGate`` turns the watchdog into a liveness check of the daemon's main
  loop: pings stop when the loop stops beating, so a hung loop gets restarted.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

import structlog

from elasticd.errors import ConfigError

log = structlog.get_logger(__name__)

# A blocked send (receiver's queue full) must not stall the caller for long.
_SEND_TIMEOUT_S = 1.0


class SystemdNotifier:
    """Send state notifications to the service manager named by ``NOTIFY_SOCKET``.

    The environment (``os.environ`` unless ``environ`` is given) is read once,
    at construction. Thread-safe.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _parse_address(env.get("NOTIFY_SOCKET"))
        self._watchdog_usec = env.get("WATCHDOG_USEC")
        self._watchdog_pid = env.get("WATCHDOG_PID")
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._failing = False

    @property
    def enabled(self) -> bool:
        """True when a notify socket was given: notifications are sent, not dropped."""
        return self._address is not None

    def send(self, text: str) -> bool:
        """Send ``text`` as one datagram; True if it was sent, False if disabled or failed."""
        if self._address is None or not text:
            return False
        with self._lock:
            try:
                self._socket().sendto(text.encode("utf-8"), self._address)
            except OSError as err:
                self._close_locked()
                self._set_failing(True, err)
                return False
            self._set_failing(False)
            return True

    def notify(self, **fields: object) -> bool:
        """Send ``KEY=value`` lines in one datagram, e.g. ``notify(READY=1, STATUS="up")``.

        Newlines in values are replaced by spaces: each assignment is one line.
        Booleans become ``1`` / ``0``.
        """
        return self.send("\n".join(f"{key}={_value(val)}" for key, val in fields.items()))

    def ready(self) -> bool:
        """``READY=1``: startup finished (and, after ``reloading()``, the reload)."""
        return self.notify(READY=1)

    def status(self, text: str) -> bool:
        """``STATUS=<text>``, shown by ``systemctl status``; one line."""
        return self.notify(STATUS=" ".join(text.splitlines()).strip())

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the daemon is alive. Prefer ``WatchdogGate.maybe_ping``."""
        return self.notify(WATCHDOG=1)

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown began."""
        return self.notify(STOPPING=1)

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (systemd >= 253 requires it with
        ``Type=notify-reload``); send ``ready()`` when the reload is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(RELOADING=1, MONOTONIC_USEC=usec)

    def watchdog_interval_s(self) -> float | None:
        """The watchdog timeout systemd enforces, or None if the watchdog is off or not ours.

        From ``WATCHDOG_USEC``; ``WATCHDOG_PID``, when set, must be this process
        (it is set for the main PID, and a child inheriting it must not ping).
        """
        if self._address is None or not self._watchdog_usec:
            return None
        if self._watchdog_pid and self._watchdog_pid.strip() != str(os.getpid()):
            return None
        try:
            usec = int(self._watchdog_usec)
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_USEC", value=self._watchdog_usec)
            return None
        return usec / 1e6 if usec > 0 else None

    def watchdog_ping_period_s(self) -> float | None:
        """How often to ping: half the watchdog interval, as sd_watchdog_enabled(3) advises."""
        interval = self.watchdog_interval_s()
        return None if interval is None else interval / 2

    def close(self) -> None:
        """Close the socket; a later send opens a new one."""
        with self._lock:
            self._close_locked()

    def _socket(self) -> socket.socket:
        if self._sock is None:
            # Python sockets are close-on-exec, so the workers we spawn do not inherit it.
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.settimeout(_SEND_TIMEOUT_S)
        return self._sock

    def _close_locked(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _set_failing(self, failing: bool, err: OSError | None = None) -> None:
        if failing == self._failing:
            return
        self._failing = failing
        if failing:
            log.warning("systemd notify failed; continuing without it", socket=self._printable(),
                        error=str(err))
        else:
            log.info("systemd notify works again", socket=self._printable())

    def _printable(self) -> str:
        return (self._address or "").replace("\0", "@", 1)


def _parse_address(value: str | None) -> str | None:
    """``NOTIFY_SOCKET`` as an AF_UNIX address: an absolute path, or ``@name`` (abstract)."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    # e.g. systemd's vsock:CID:PORT (VMs); not something a training node runs under.
    log.warning("unsupported NOTIFY_SOCKET; notifications disabled", value=value)
    return None


def _value(val: object) -> str:
    if isinstance(val, bool):
        return "1" if val else "0"
    return " ".join(str(val).splitlines())


class WatchdogGate:
    """Ping the systemd watchdog only while the daemon's main loop is alive.

    The main loop calls ``beat()`` each healthy cycle; whoever pings (the loop
    itself or a helper thread) calls ``maybe_ping(notifier)`` about every
    ``interval_s / 2``. A ping is sent only if the last beat is at most
    ``interval_s / 2`` old, so a hung loop is restarted by systemd within about
    ``1.5 * interval_s``. Construction counts as a beat: startup has the same grace.
    """

    def __init__(self, interval_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float) \
                or not math.isfinite(interval_s) or interval_s <= 0:
            raise ConfigError(f"watchdog interval_s={interval_s!r} must be a number of seconds > 0 "
                              "(systemd's WatchdogSec)")
        self.interval_s = float(interval_s)
        self.max_beat_age_s = self.interval_s / 2
        self._clock = clock
        self._last_beat = clock()
        self._stalled = False

    @classmethod
    def for_notifier(cls, notifier: SystemdNotifier, *,
                     clock: Callable[[], float] = time.monotonic) -> WatchdogGate | None:
        """A gate sized to the notifier's watchdog, or None if systemd runs no watchdog for us."""
        interval = notifier.watchdog_interval_s()
        return None if interval is None else cls(interval, clock=clock)

    def beat(self) -> None:
        """The main loop completed a healthy cycle."""
        self._last_beat = self._clock()

    def beat_age_s(self) -> float:
        """Seconds since the last beat."""
        return self._clock() - self._last_beat

    def healthy(self) -> bool:
        """True if the last beat is recent enough to vouch for the main loop."""
        return self.beat_age_s() <= self.max_beat_age_s

    def maybe_ping(self, notifier: SystemdNotifier) -> bool:
        """Send ``WATCHDOG=1`` if ``healthy()``; True if a ping was sent."""
        age = self.beat_age_s()
        if age > self.max_beat_age_s:
            if not self._stalled:
                self._stalled = True
                log.error("main loop stalled; withholding watchdog pings so systemd restarts us",
                          beat_age_s=round(age, 3), watchdog_s=self.interval_s)
            return False
        if self._stalled:
            self._stalled = False
            log.warning("main loop beating again; watchdog pings resume", beat_age_s=round(age, 3))
        return notifier.watchdog()
