"""The torchrun command line, the environment and the agent process the daemon builds."""

from __future__ import annotations

import inspect
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from elasticd import proctree
from elasticd.agent import (
    AgentProcess,
    RunFiles,
    etcd_auth,
    prune_log_dirs,
    rotate_log,
    torch_restart_count,
    torchrun_command,
    worker_env,
    worker_settings,
)
from elasticd.config import config_from_dict
from elasticd.contract.settings import (
    DEFAULT_LR_RULE,
    ETCD_AUTH_STDIN_VAR,
    WorkerSettings,
    decode_etcd_auth,
)
from elasticd.warmstart import WarmHost

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


# -- the worker contract in the environment ---------------------------------------------------

AUTH_CONFIG = config_from_dict({
    "job": {"id": "j1", "entrypoint": ["train.py"]},
    "etcd": {"endpoints": ["127.0.0.1:2379"], "user": "elastic", "password": 'pa"ss\nword'},
    "node": {"id": "n1"},
})


def test_environment_is_the_contract_and_round_trips(tmp_path):
    env = worker_env(CONFIG, RunFiles(tmp_path), base={})
    settings = WorkerSettings.from_env(env)
    assert settings == worker_settings(CONFIG, RunFiles(tmp_path))
    assert settings.to_env().items() <= env.items()
    assert settings.lr_rule == DEFAULT_LR_RULE == CONFIG.lr.rule
    assert settings.checkpoint_every_s == 30.0 and settings.checkpoint_every_steps is None


def test_the_lr_base_is_the_jobs_first_world_unless_the_config_names_one(tmp_path):
    """Before: the daemon always passed base 1, so a script that scales its own LR
    (lr * world_size) got it scaled again: 3x the intended LR at world 3; a script without
    its own scaling got 2x at world 2 where plain torchrun kept it."""
    from trainer.lr import start_scale

    env = worker_env(CONFIG, RunFiles(tmp_path), base={})
    assert "ELASTICD_LR_BASE_WORLD_SIZE" not in env
    base = WorkerSettings.from_env(env).lr_base_world_size
    first = start_scale(None, 0, 3, "linear", base_world_size=base)
    assert (first.base_world_size, first.factor(1)) == (3, 1.0)   # the first world: the script's LR
    named = config_from_dict({"job": {"id": "j1", "entrypoint": ["train.py"]}, "node": {"id": "n1"},
                              "lr": {"base_world_size": 16}})
    assert worker_env(named, RunFiles(tmp_path), base={})["ELASTICD_LR_BASE_WORLD_SIZE"] == "16"


def test_stale_contract_and_secret_variables_of_the_daemon_do_not_leak(tmp_path):
    base = {"ELASTICD_CHECKPOINT_EVERY_STEPS": "5", "ELASTICD_ETCD_USER": "elastic",
            "ELASTICD_ETCD_PASSWORD": "leaked", "ELASTICD_ETCD_AUTH_STDIN": "1"}
    env = worker_env(CONFIG, RunFiles(tmp_path), base=base)
    assert "ELASTICD_CHECKPOINT_EVERY_STEPS" not in env  # the config says 0: not by steps
    assert not any(k.startswith("ELASTICD_ETCD_") for k in env)
    assert "leaked" not in "".join(env.values())


def test_etcd_credentials_are_never_in_the_agent_environment(tmp_path):
    env = worker_env(AUTH_CONFIG, RunFiles(tmp_path), base={"PATH": "/bin"})
    assert env[ETCD_AUTH_STDIN_VAR] == "1"
    assert "ELASTICD_ETCD_USER" not in env and "ELASTICD_ETCD_PASSWORD" not in env
    assert not any("pa\"ss" in v for v in env.values())
    assert "pa" not in repr(etcd_auth(AUTH_CONFIG)).split("user=")[1]  # repr hides the password
    assert etcd_auth(CONFIG) is None


# A fake "torchrun": records its stdin (bytes), what fd 0 is and its environment.
_RECORDER = textwrap.dedent("""
    import json, os, sys
    data = sys.stdin.buffer.read()
    with open(sys.argv[1], "w") as f:
        json.dump({"stdin": data.hex(), "fd0": os.readlink("/proc/self/fd/0"),
                   "env": dict(os.environ)}, f)
""")


def _run_recorder(tmp_path: Path, config, auth) -> dict:
    out = tmp_path / "record.json"
    files = RunFiles(tmp_path / "run")
    agent = AgentProcess([sys.executable, "-c", _RECORDER, str(out)],
                         worker_env(config, files), files.agent_log, etcd_auth=auth)
    agent.start()
    assert agent.proc.wait(30) == 0, files.agent_log.read_text()
    return json.loads(out.read_text())


def test_agent_reads_the_credentials_as_one_json_line_on_stdin(tmp_path):
    record = _run_recorder(tmp_path, AUTH_CONFIG, etcd_auth(AUTH_CONFIG))
    line = bytes.fromhex(record["stdin"])
    assert line == b'{"user": "elastic", "password": "pa\\"ss\\nword"}\n'  # exactly, then EOF
    assert decode_etcd_auth(io.BytesIO(line)) == ("elastic", 'pa"ss\nword')
    assert record["fd0"].startswith("pipe:")
    assert record["env"][ETCD_AUTH_STDIN_VAR] == "1"
    assert not any("pa\"ss" in v for v in record["env"].values())


def test_without_auth_stdin_stays_dev_null(tmp_path):
    record = _run_recorder(tmp_path, CONFIG, None)
    assert record["stdin"] == "" and record["fd0"] == "/dev/null"
    assert ETCD_AUTH_STDIN_VAR not in record["env"]


def test_auth_flag_and_credentials_must_agree(tmp_path):
    files = RunFiles(tmp_path)
    with pytest.raises(ValueError, match="etcd_auth is missing"):
        AgentProcess(["true"], worker_env(AUTH_CONFIG, files), files.agent_log)
    with pytest.raises(ValueError, match="etcd_auth is given"):
        AgentProcess(["true"], worker_env(CONFIG, files), files.agent_log,
                     etcd_auth=etcd_auth(AUTH_CONFIG))


# -- the agent forked warm -----------------------------------------------------------------

@pytest.fixture
def warm_host(tmp_path, monkeypatch):
    """A ready warm-start server (a light import list) and the recorder as a module."""
    (tmp_path / "recorder_mod.py").write_text(_RECORDER)
    monkeypatch.chdir(tmp_path)   # ``-m`` finds its module in the working directory
    host = WarmHost(sys.executable, tmp_path / "warm.sock", tmp_path / "warm.log")
    host.imports = ("json",)
    host.start(dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert proctree.wait_for(lambda: host.state() == "ready", 60), host.log_path.read_text()
    yield host
    host.stop()


def test_a_ready_warm_server_forks_the_agent_with_its_credentials_on_stdin(tmp_path, warm_host):
    out, files = tmp_path / "record.json", RunFiles(tmp_path / "run")
    agent = AgentProcess([sys.executable, "-m", "recorder_mod", str(out)],
                         worker_env(AUTH_CONFIG, files), files.agent_log,
                         etcd_auth=etcd_auth(AUTH_CONFIG), warm=warm_host)
    pid = agent.start()
    assert agent.started_warm and psutil.Process(pid).ppid() == warm_host.proc.pid
    assert agent.proc.wait(30) == 0 and agent.exit_code() == 0, files.agent_log.read_text()
    record = json.loads(out.read_text())
    assert bytes.fromhex(record["stdin"]) == b'{"user": "elastic", "password": "pa\\"ss\\nword"}\n'
    assert record["fd0"].startswith("pipe:") and record["env"][ETCD_AUTH_STDIN_VAR] == "1"
    assert not any('pa"ss' in v for v in record["env"].values())
    environ = Path(f"/proc/{warm_host.proc.pid}/environ").read_bytes()   # what the fork shows
    assert b"pa\"ss" not in environ


def test_the_agent_starts_cold_unless_the_warm_server_is_ready(tmp_path, monkeypatch):
    (tmp_path / "recorder_mod.py").write_text(_RECORDER)
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.chdir(tmp_path)
    host = WarmHost(sys.executable, tmp_path / "warm.sock", tmp_path / "warm.log")
    host.imports = ("slow_import",)   # a server still importing (torch takes seconds)
    host.start(dict(os.environ, PYTHONPATH=f"{tmp_path}:{Path(__file__).resolve().parents[2]}"))
    try:
        assert proctree.wait_for(lambda: host.socket_path.exists(), 30)
        out, files = tmp_path / "record.json", RunFiles(tmp_path / "run")
        agent = AgentProcess([sys.executable, "-m", "recorder_mod", str(out)],
                             worker_env(CONFIG, files), files.agent_log, warm=host)
        agent.start()
        assert host.state() == "importing"
        assert not agent.started_warm and agent.proc.wait(30) == 0
        assert json.loads(out.read_text())["fd0"] == "/dev/null"
    finally:
        host.stop()


# -- the parent-death signal ----------------------------------------------------------------

# A "daemon": starts an agent (sleeps) with AgentProcess while another thread runs (the
# daemon's prober, lease keeper), prints the agent's pid, then waits to be SIGKILLed.
_DAEMON = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from elasticd import proctree
    from elasticd.agent import AgentProcess
    proctree.SETPRIV = sys.argv[2]
    threading.Thread(target=lambda: [time.sleep(0.001) for _ in iter(int, 1)], daemon=True).start()
    run = Path(sys.argv[1])
    agent = AgentProcess([sys.executable, "-c", "import time; time.sleep(60)"],
                         {"TMPDIR": str(run / "tmp"), "PATH": "/usr/bin:/bin"}, run / "agent.log")
    print(agent.start(), flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("setpriv", [proctree.SETPRIV, ""], ids=["setpriv", "python-fallback"])
def test_a_sigkilled_daemon_takes_its_agent_along(tmp_path, setpriv):
    if setpriv and not os.access(setpriv, os.X_OK):
        pytest.skip(f"{setpriv} is not installed")
    daemon = subprocess.Popen([sys.executable, "-c", _DAEMON, str(tmp_path), setpriv],
                              stdout=subprocess.PIPE, text=True)
    try:
        agent_pid = int(daemon.stdout.readline())
        agent = psutil.Process(agent_pid)
        # Once the wrapper has become the command, the signal is set (before that, killing
        # the daemon tests the parent check instead: test_orphaned_before_the_signal_...).
        assert proctree.wait_for(lambda: agent.cmdline()[:2] == [sys.executable, "-c"], 10)
        assert proctree.pid_alive(agent)
    finally:
        daemon.kill()
        daemon.wait()
    started = time.monotonic()
    assert proctree.wait_for(lambda: not proctree.pid_alive(agent_pid), 5)  # pytest adopts it
    assert time.monotonic() - started < 1.0
    proctree.reap_children()


def test_the_command_is_prefixed_not_forked_with_python():
    cmd = proctree.with_parent_death_signal(["torchrun", "x"])
    if os.access(proctree.SETPRIV, os.X_OK):
        assert cmd[:5] == [proctree.SETPRIV, "--pdeathsig", "KILL", "--", "/bin/sh"]
    assert cmd[-3:] == [str(os.getpid()), "torchrun", "x"]
    fallback = proctree.with_parent_death_signal(["torchrun", "x"], setpriv="")
    assert fallback[0] == sys.executable and fallback[-3:] == [str(os.getpid()), "torchrun", "x"]
    assert "preexec_fn=" not in inspect.getsource(AgentProcess.start)


@pytest.mark.parametrize("setpriv", [proctree.SETPRIV, ""], ids=["setpriv", "python-fallback"])
def test_orphaned_before_the_signal_was_set_the_command_never_runs(tmp_path, setpriv):
    """A parent that died between fork and prctl: the child sees another parent and exits."""
    if setpriv and not os.access(setpriv, os.X_OK):
        pytest.skip(f"{setpriv} is not installed")
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    # parent_pid=1 stands for "the parent that started me": it is not our parent.
    wrapped = proctree.with_parent_death_signal(command, setpriv=setpriv, parent_pid=1)
    assert subprocess.run(wrapped, timeout=30).returncode == 1
    assert not marker.exists()
    ok = proctree.with_parent_death_signal(command, setpriv=setpriv)
    assert subprocess.run(ok, timeout=30).returncode == 0 and marker.exists()


# -- agent.log rotation ---------------------------------------------------------------------

def test_agent_log_is_rotated_at_start_when_too_big(tmp_path):
    files = RunFiles(tmp_path)
    env = worker_env(CONFIG, files, base={"PATH": "/bin"})
    for i in range(6):
        agent = AgentProcess([sys.executable, "-c", f"print('life {i}', 'x' * 200)"], env,
                             files.agent_log, log_max_bytes=100, log_keep=3)
        agent.start()
        assert agent.proc.wait(30) == 0
    logs = sorted(p.name for p in tmp_path.glob("agent.log*"))
    assert logs == ["agent.log", "agent.log.1", "agent.log.2", "agent.log.3"]
    assert files.agent_log.read_text().startswith("life 5")
    assert (tmp_path / "agent.log.1").read_text().startswith("life 4")
    assert (tmp_path / "agent.log.3").read_text().startswith("life 2")


def test_small_agent_log_is_appended_to(tmp_path):
    log_path = tmp_path / "agent.log"
    log_path.write_text("old\n")
    assert not rotate_log(log_path, max_bytes=100)
    log_path.write_text("x" * 101)
    assert rotate_log(log_path, max_bytes=100, keep=2) and not log_path.exists()
    assert (tmp_path / "agent.log.1").read_text() == "x" * 101
    assert not rotate_log(tmp_path / "missing.log")


def test_started_at_is_gone():
    assert not hasattr(AgentProcess(["true"], {"TMPDIR": "/tmp"}, Path("/tmp/x")), "started_at")


def test_the_workers_get_the_recovery_settings_and_the_generation_file(tmp_path):
    config = config_from_dict({"job": {"id": "demo", "entrypoint": ["train.py"]},
                               "recovery": {"mode": "restart", "bound_s": 3,
                                            "reform": "destroy-init",
                                            "secret_file": "/etc/elasticd/job.secret"}})
    settings = worker_settings(config, RunFiles(tmp_path))
    assert (settings.recovery_mode, settings.recovery_bound_s) == ("restart", 3.0)
    assert settings.to_env()["ELASTICD_REFORM"] == "destroy-init"
    assert settings.to_env()["ELASTICD_SECRET_FILE"] == "/etc/elasticd/job.secret"  # its path only
    assert settings.generation_file == str(tmp_path / "generation.json")
    assert worker_settings(CONFIG, RunFiles(tmp_path)).recovery_mode == "in-place"
    assert "ELASTICD_SECRET_FILE" not in worker_settings(CONFIG, RunFiles(tmp_path)).to_env()


def test_torchs_restart_count_is_read_from_the_workers_environment():
    """What the supervisor tells a membership restart from a crash by (torch raises it for
    a failure only); None when no worker says (plain processes, or one already gone)."""
    env = dict(os.environ, TORCHELASTIC_RESTART_COUNT="3")
    counted = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={k: v for k, v in env.items() if k != "TORCHELASTIC_RESTART_COUNT"})
    try:
        procs = [psutil.Process(counted.pid), psutil.Process(plain.pid)]
        assert torch_restart_count(procs) == 3
        assert torch_restart_count(procs[1:]) is None
        assert torch_restart_count([]) is None
    finally:
        for proc in (counted, plain):
            proc.kill()
            proc.wait()
