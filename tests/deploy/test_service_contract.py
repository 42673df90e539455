"""The dev example config, run the way elasticd.service runs the daemon: a notify socket
and the unit's watchdog interval in the environment, SIGTERM to the daemon alone to stop.

systemd itself cannot run here (no systemd as PID 1), so the test plays its part: it
expects READY=1 within TimeoutStartSec, and after SIGTERM an exit status of 0 (which
RestartPreventExitStatus=0 keeps from being restarted) within TimeoutStopSec, with no
process left behind (what KillMode=mixed would otherwise SIGKILL). The daemon's own
notify and drain behaviour is tested in tests/daemon/test_drain.py.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from elasticd import proctree
from tests.deploy.conftest import DEPLOY, REPO, NotifySocket
from tests.deploy.test_units import UNITS, one, parse_unit, seconds


@pytest.mark.slow
def test_dev_config_under_the_unit_contract(fresh_etcd, tmp_path, job_id):
    unit = parse_unit(UNITS / "elasticd.service")
    start_s = seconds(one(unit, "Service", "TimeoutStartSec"))
    stop_s = seconds(one(unit, "Service", "TimeoutStopSec"))
    watchdog_s = seconds(one(unit, "Service", "WatchdogSec"))

    notify = NotifySocket(tmp_path / "notify.sock")
    received, until = notify.received, notify.until
    env = {**os.environ, "NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": str(int(watchdog_s * 1e6)),
           "ELASTICD_ETCD_ENDPOINTS": fresh_etcd.endpoint, "ELASTICD_JOB_ID": job_id,
           "ELASTICD_NODE_ID": "node-a", "ELASTICD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "TMPDIR": str(tmp_path)}   # the daemon's default run dir
    before = {p.pid for p in proctree.descendants()}   # the etcd server
    # From the repository root, as the config's comments say (the entrypoint is relative).
    with open(tmp_path / "daemon.log", "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "elasticd", "run", "--config",
             str(DEPLOY / "config/dev-single-machine.toml")],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def tail() -> str:
            return (tmp_path / "daemon.log").read_text(errors="replace")[-3000:]

        assert until(lambda: "READY=1" in received, min(start_s, 120)), tail()
        training = re.compile(r"STATUS=running: step \d+")
        assert until(lambda: any(training.match(m) for m in received), 120), (received[-5:], tail())
        assert until(lambda: "WATCHDOG=1" in received, watchdog_s), received[-5:]

        began = time.monotonic()
        daemon.send_signal(signal.SIGTERM)     # KillMode=mixed: the main process only
        assert daemon.wait(timeout=stop_s) == 0, tail()
        assert time.monotonic() - began < stop_s
        until(lambda: "STOPPING=1" in received, 1)
        assert "STOPPING=1" in received
        proctree.reap_children()
        left = [p.pid for p in proctree.descendants() if p.pid not in before]
        assert not left, "the daemon left processes for systemd to SIGKILL"
    finally:
        if daemon.poll() is None:
            proctree.kill_tree(daemon.pid)
            daemon.wait()
        notify.close()
