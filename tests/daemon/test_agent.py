"""The torchrun command line and environment the daemon builds (no processes)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from elasticd.agent import RunFiles, prune_log_dirs, torchrun_command, worker_env
from elasticd.config import config_from_dict

CONFIG = config_from_dict({
    "job": {"id": "j1", "entrypoint": ["train.py", "--x", "1"], "min_nodes": 2, "max_nodes": 4},
    "etcd": {"endpoints": ["10.0.0.1:2379", "http://10.0.0.2:2380"]},
    "node": {"id": "n1", "addr": "10.0.1.5"},
    "checkpoint": {"dir": "/ckpt", "every_steps": 0, "every_s": 30.0},
})


def test_command_is_plain_torchrun_with_the_etcd3_backend():
    cmd = torchrun_command(CONFIG, 2, Path("/logs"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--rdzv-backend=etcd3" in cmd
    assert "--rdzv-endpoint=10.0.0.1:2379,10.0.0.2:2380" in cmd
    assert "--nnodes=2:4" in cmd and "--nproc-per-node=2" in cmd and "--rdzv-id=j1" in cmd
    assert "--local-addr=10.0.1.5" in cmd and "--log-dir=/logs" in cmd
    conf = next(a for a in cmd if a.startswith("--rdzv-conf="))
    assert "last_call_timeout=1" in conf and "key_prefix=/elasticd" in conf
    assert cmd[-3:] == ["train.py", "--x", "1"]


def test_environment_carries_the_worker_contract(tmp_path):
    env = worker_env(CONFIG, RunFiles(tmp_path), base={"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": "1",
                                                       "PATH": "/bin"})
    assert env["ELASTICD_JOB_ID"] == "j1" and env["ELASTICD_CHECKPOINT_DIR"] == "/ckpt"
    assert env["ELASTICD_CHECKPOINT_EVERY_S"] == "30.0"
    assert "ELASTICD_CHECKPOINT_EVERY_STEPS" not in env      # 0 = not by steps
    assert env["ELASTICD_STOP_FILE"] == str(tmp_path / "stop")
    assert env["ELASTICD_DAEMON_PID"] == str(os.getpid())
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
    assert env["PATH"] == "/bin"


def test_prune_keeps_the_newest_log_dirs(tmp_path):
    for i in range(7):
        d = tmp_path / f"run_{i}"
        d.mkdir()
        os.utime(d, (time.time() - 100 + i, time.time() - 100 + i))
    prune_log_dirs(tmp_path, keep=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"run_{i}" for i in range(2, 7)]
