"""The daemon object without processes: a failing cycle is survived, never beats the watchdog."""

from __future__ import annotations

from structlog.testing import capture_logs

from elasticd.config import config_from_dict
from elasticd.daemon import Daemon
from elasticd.sdnotify import SystemdNotifier
from tests.daemon.test_sdnotify import FakeClock


def test_a_cycle_that_raises_is_logged_and_does_not_beat_the_watchdog(tmp_path):
    config = config_from_dict({"job": {"id": "unit", "entrypoint": ["train.py"]},
                               "node": {"id": "a", "run_dir": str(tmp_path)}})
    clock = FakeClock()
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "none.sock"), "WATCHDOG_USEC": "4000000"})
    daemon = Daemon(config, clock=clock, notifier=notifier)
    clock.now += 3.0                       # older than half the watchdog interval
    with capture_logs() as logs:
        daemon._cycle_guarded()          # not connected: observe() raises
    assert any(e["event"] == "daemon cycle failed; retrying at the next tick" for e in logs)
    assert not daemon.watchdog.healthy()


def test_a_run_dir_the_daemon_made_up_is_named_in_its_last_line_and_a_configured_one_is_not(tmp_path):
    job = {"id": "unit", "entrypoint": ["train.py"]}
    own = Daemon(config_from_dict({"job": job, "node": {"id": "a", "run_dir": str(tmp_path)}}))
    assert own.run_dir_note() == {}
    made_up = Daemon(config_from_dict({"job": job, "node": {"id": "a"}}))
    try:
        note = made_up.run_dir_note()
        assert note["run_dir_kept"] == str(made_up.files.run_dir) and "[node] run_dir" in note["note"]
        assert made_up.files.run_dir.name.startswith("elasticd-a-")
    finally:
        made_up.files.run_dir.rmdir()


def test_the_last_line_of_a_completed_job_says_how_to_start_the_next_run(tmp_path):
    """A daemon started again on a completed job stops at once ("nothing left to run"):
    its last line names what must change, a new job id or the old keys deleted, and that
    the workers would resume from the same checkpoint directory."""
    from dataclasses import replace

    from elasticd.daemon import next_run_hint
    from elasticd.supervisor import Phase

    config = config_from_dict({
        "job": {"id": "unit", "entrypoint": ["train.py"]},
        "node": {"id": "a", "run_dir": str(tmp_path)},
        "etcd": {"endpoints": ["10.0.0.1:2379", "10.0.0.2:2379"], "key_prefix": "/jobs"},
        "checkpoint": {"dir": str(tmp_path / "ckpt")}})
    hint = next_run_hint(config)
    assert "job 'unit' is complete" in hint and "/jobs/unit/state says completed" in hint
    assert "a new [job] id (or ELASTICD_JOB_ID)" in hint
    assert ("etcdctl --endpoints=10.0.0.1:2379,10.0.0.2:2379 del --prefix /jobs/unit/"
            in hint), hint
    assert f"newest checkpoint in {tmp_path / 'ckpt'}" in hint and "[checkpoint] dir" in hint
    daemon = Daemon(config)
    assert "next_run" not in daemon.last_words()            # running, failed, drained: none
    daemon.memory = replace(daemon.memory, phase=Phase.FAILED)
    assert "next_run" not in daemon.last_words()
    daemon.memory = replace(daemon.memory, phase=Phase.COMPLETED)
    assert daemon.last_words() == {"next_run": hint}
