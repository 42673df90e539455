"""StopRequest: signals and the stop file set one flag; nothing else happens in the handler."""

from __future__ import annotations

import os
import signal

import pytest

from trainer.stop import StopRequest


@pytest.fixture
def stop():
    request = StopRequest().install()
    yield request
    request.uninstall()


def test_sigterm_sets_the_flag_and_keeps_running(stop):
    assert not stop.requested()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested() and stop.reason == "SIGTERM"


def test_second_sigint_interrupts(stop):
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested()
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_uninstall_restores_previous_handlers():
    before = signal.getsignal(signal.SIGTERM)
    request = StopRequest().install()
    assert signal.getsignal(signal.SIGTERM) != before
    request.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_stop_file_counts_like_sigterm_checked_at_most_every_interval(tmp_path):
    now = [0.0]
    path = tmp_path / "stop"
    request = StopRequest(str(path), check_interval_s=1.0, clock=lambda: now[0])
    assert not request.requested()
    path.touch()
    now[0] = 0.5
    assert not request.requested()  # throttled: no stat until the interval passed
    now[0] = 1.0
    assert request.requested() and request.reason == f"stop file {path}"
