"""etcd credentials reach the agent (stdin or env) and never its workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.rendezvous import handler

PROBE = Path(__file__).with_name("env_probe_worker.py")
REPO = Path(__file__).resolve().parents[2]

# Runs in a child whose stdin is the pipe under test: take the credentials, then report
# what is left (environment, fd 0) as JSON on stdout.
_TAKE = """
import json, os, sys
from elasticd.errors import ConfigError
from elasticd.rendezvous import handler
handler.STDIN_TIMEOUT_S = float(os.environ.get("T", "10"))
try:
    creds = handler.take_credentials()
    again = handler.take_credentials()
    error = None
except ConfigError as exc:
    creds = again = None
    error = str(exc)
print(json.dumps({"creds": creds, "again": again, "error": error,
                  "env": sorted(k for k in os.environ if k.startswith("ELASTICD_ETCD")),
                  "fd0": os.readlink("/proc/self/fd/0"), "rest": os.read(0, 100).decode()}))
"""


def take(stdin: bytes | None, env: dict[str, str], timeout_s: float = 10) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_ETCD")}
    full.update(env, T=str(timeout_s))
    proc = subprocess.Popen([sys.executable, "-c", _TAKE], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=full, cwd=REPO)
    try:
        if stdin is not None:
            proc.stdin.write(stdin)
            proc.stdin.flush()
        out, _ = proc.communicate(timeout=30) if stdin is not None else _wait_open(proc)
    finally:
        proc.kill()
        proc.wait()
    return json.loads(out)


def _wait_open(proc: subprocess.Popen) -> tuple[bytes, None]:
    """The writer keeps stdin open and silent (a daemon that forgot to write)."""
    out = proc.stdout.read()
    proc.stdin.close()
    return out, None


@pytest.mark.slow
def test_stdin_line_is_read_once_and_nothing_is_left_for_workers():
    line = json.dumps({"user": "job-a", "password": "s3cret"}).encode() + b"\nleftover\n"
    out = take(line, {"ELASTICD_ETCD_AUTH_STDIN": "1", "ELASTICD_ETCD_USER": "old",
                      "ELASTICD_ETCD_PASSWORD": "old-pw"})
    assert out["error"] is None
    assert out["creds"] == out["again"] == ["job-a", "s3cret"]
    assert out["env"] == []
    assert out["fd0"] == "/dev/null" and out["rest"] == ""


@pytest.mark.process
def test_env_credentials_are_used_and_removed_from_the_environment():
    out = take(b"", {"ELASTICD_ETCD_USER": "u", "ELASTICD_ETCD_PASSWORD": "p"})
    assert out["creds"] == ["u", "p"] and out["env"] == []


@pytest.mark.parametrize("line, message", [
    (b"user=a password=b\n", "stdin line is not JSON"),
    (b'["a", "b"]\n', "not a JSON object"),
    (b'{"user": "a"}\n', "lacks password"),
    (b'{"password": "p", "user": ""}\n', "lacks user"),
    (b"", "stdin was empty"),
])
@pytest.mark.slow
def test_bad_stdin_is_a_config_error_naming_the_problem_and_the_fix(line, message):
    out = take(line, {"ELASTICD_ETCD_AUTH_STDIN": "1"})
    assert message in out["error"] and "must write one line" in out["error"]
    assert "p\"" not in out["error"]        # the line itself is never echoed
    assert out["fd0"] == "/dev/null" and out["env"] == []


@pytest.mark.process
def test_a_silent_stdin_times_out_with_a_clear_error():
    out = take(None, {"ELASTICD_ETCD_AUTH_STDIN": "1"}, timeout_s=0.5)
    assert "no credentials line arrived on stdin within" in out["error"]


def test_parse_params_takes_the_stdin_credentials(monkeypatch):
    monkeypatch.setattr(handler, "_stdin_credentials", ("from-stdin", "pw"))
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    settings = handler.parse_params(RendezvousParameters("etcd3", "127.0.0.1:2379", "j", 1, 2)).etcd
    assert (settings.user, settings.password) == ("from-stdin", "pw")


@pytest.mark.process
def test_torchrun_workers_never_see_the_credentials(auth_etcd, tmp_path, job_id):
    """A real agent against an etcd with auth on, given the password on stdin only."""
    password = "rootpw"   # auth_etcd's root password
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_ETCD")}
    env.update(REPORT_DIR=str(tmp_path), ELASTICD_ETCD_AUTH_STDIN="1",
               ELASTICD_ETCD_USER="decoy-user", ELASTICD_ETCD_PASSWORD="decoy-password")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=etcd3",
           f"--rdzv-endpoint={auth_etcd.endpoint}", f"--rdzv-id={job_id}", "--nnodes=1",
           "--nproc-per-node=2", "--max-restarts=0", "--local-addr=127.0.0.1",
           "--monitor-interval=0.1", "--rdzv-conf=last_call_timeout=1,join_timeout=60",
           str(PROBE)]
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO)
    try:
        proc.stdin.write(json.dumps({"user": "root", "password": password}).encode() + b"\n")
        proc.stdin.close()
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert code == 0, log.read_text()[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"probe-{rank}.json").read_text())
        assert report["elasticd_etcd_vars"] == []
        assert password not in report["environ"] and "decoy-password" not in report["environ"]
        assert report["stdin"] == "" and report["stdin_target"] == "/dev/null"
