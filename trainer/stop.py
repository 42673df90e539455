"""Stop requests: SIGTERM, SIGINT and the daemon's stop file, noticed at step boundaries.

A signal only sets a flag; the training loop asks ``requested()`` at each step
boundary and the ranks agree on it with one collective (``dist.step_boundary``),
so every rank stops after the same step and rank 0 can checkpoint it.

torchrun sends SIGTERM to its workers both when it is stopped and when it
restarts them for a membership change, and waits 30 s before SIGKILL: that is
the budget for the stop checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Whether this process has been asked to stop.

    ``stop_file``: when this path exists it counts exactly like a SIGTERM (the
    daemon drains workers this way). Checked at most every ``check_interval_s``
    so the training loop does not stat a file every step.
    """

    def __init__(
        self,
        stop_file: str | None = None,
        check_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stop_file = stop_file
        self.check_interval_s = check_interval_s
        self._clock = clock
        self._next_check = float("-inf")
        self._event = threading.Event()
        self.reason: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequest:
        """Catch SIGTERM/SIGINT; a second SIGINT interrupts at once.

        Python delivers signals to the main thread only: elsewhere this installs
        nothing and only the stop file (and peers' stops) can stop this worker.
        """
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Restore the handlers that were in place before ``install``."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def request(self, reason: str) -> None:
        """Ask for a stop (idempotent; the first reason is kept)."""
        if not self._event.is_set():
            self.reason = reason
            self._event.set()
            # No logging here: this runs inside a signal handler, and a write that
            # interrupts another write to the same stream raises "reentrant call".

    def requested(self) -> bool:
        """True once a signal arrived or the stop file appeared."""
        if self._event.is_set():
            return True
        if self.stop_file and self._clock() >= self._next_check:
            self._next_check = self._clock() + self.check_interval_s
            if os.path.exists(self.stop_file):
                self.request(f"stop file {self.stop_file}")
        return self._event.is_set()

    def _on_signal(self, signum: int, _frame) -> None:
        if signum == signal.SIGINT and self._event.is_set():
            raise KeyboardInterrupt
        self.request(signal.Signals(signum).name)
