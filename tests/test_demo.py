"""`elasticd demo` end to end, small: the summary and the timeline picture are produced."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(600)
def test_demo_runs_recovers_and_draws(tmp_path):
    out = tmp_path / "out"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "elasticd", "demo", "--steps", "60", "--crash-at", "20",
         "--rejoin-after", "3", "--out", str(out)],
        capture_output=True, text=True, timeout=580, env=dict(os.environ, TMPDIR=str(scratch)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["completed"] and summary["recovery_s"] > 0 and summary["rejoin_s"] > 0, summary
    assert summary["steps_lost"] is not None and 0 <= summary["steps_lost"] <= 25, summary
    png = out / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "recovery (crash -> first step at world size 2)" in result.stdout
    assert not list(scratch.iterdir()), "the demo left temp files"


@pytest.mark.timeout(300)
def test_demo_ctrl_c_cleans_up(tmp_path):
    import signal
    import time

    from elasticd import proctree

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    demo = subprocess.Popen([sys.executable, "-m", "elasticd", "demo", "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, TMPDIR=str(scratch), PYTHONUNBUFFERED="1"))
    assert "starting 3 nodes" in demo.stdout.readline() + demo.stdout.readline()
    # etcd, 3 daemons and their agents at least: a loaded machine takes longer than a fixed
    # sleep to import torch in every daemon, so wait for the tree (and a bit for workers).
    try:
        assert proctree.wait_for(lambda: len(proctree.descendants(demo.pid)) >= 7, 120, 0.5), \
            proctree.descendants(demo.pid)
    except AssertionError:
        proctree.kill_tree(demo.pid)
        raise
    time.sleep(2)
    demo.send_signal(signal.SIGINT)
    out, _ = demo.communicate(timeout=120)
    assert demo.returncode != 0 and "interrupted; every process and temp file was removed" in out, out
    assert not list(scratch.iterdir()), "the demo left temp files"
