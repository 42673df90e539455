"""The workers' own Unix user (elasticd.contract.identity): what a worker becomes on each
launch path, what the daemon refuses to start with, and the files they share.

Real processes as real users: the tests run as root (the daemon's case with
``User=root``) and, through ``setpriv``, as a non-root user holding only the ambient
capabilities the shipped unit grants (``User=elasticd``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd import proctree
from elasticd.config import check_worker_user, load_config
from elasticd.contract.files import write_atomic
from elasticd.contract.identity import (
    SETPRIV,
    WORKER_USER_VAR,
    IdentityError,
    WorkerIdentity,
    resolve,
    share,
    switch_refusal,
    worker_can,
)
from elasticd.errors import ConfigError
from elasticd.lab.local_cluster import write_config
from elasticd.warmstart import spawn

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root here")

REPO = Path(__file__).resolve().parents[2]
NOBODY = resolve("nobody")
# A non-root daemon as the shipped unit runs it: uid 1 (daemon) with the ambient set.
AS_DAEMON_USER = [SETPRIV, "--reuid=1", "--regid=1", "--clear-groups",
                  "--inh-caps=+kill,+setgid,+setuid", "--ambient-caps=+kill,+setgid,+setuid"]
SYSTEM_PYTHON = "/usr/bin/python3"
REPORT = """
import json, os, sys
from elasticd.contract.identity import capabilities
print(json.dumps({"uid": os.getresuid(), "gid": os.getresgid(), "groups": os.getgroups(),
                  "caps": capabilities(), "home": os.environ.get("HOME"), "cwd": os.getcwd()}),
      flush=True)
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


def _as_worker(report: dict) -> None:
    assert report["uid"] == [NOBODY.uid] * 3 and report["gid"] == [NOBODY.gid] * 3, report
    assert report["caps"] == 0 and report["home"] == "/nonexistent", report


def test_an_identity_round_trips_and_garbage_names_the_variable():
    identity = WorkerIdentity(1000, 1001, (5, 7))
    assert WorkerIdentity.decode(identity.encode()) == identity
    with pytest.raises(IdentityError, match=WORKER_USER_VAR):
        WorkerIdentity.decode("nobody")


@pytest.mark.parametrize(("user", "group", "says"), [
    ("no-such-user-x", "", "useradd"), ("root", "", "unprivileged"), ("0", "", "unprivileged"),
    ("nobody", "no-such-group-x", "groupadd")])
def test_an_unusable_user_or_group_says_the_fix(user, group, says):
    with pytest.raises(IdentityError, match=says):
        resolve(user, group)


def test_a_user_by_number_and_a_named_group():
    assert resolve(str(NOBODY.uid), "nogroup") == NOBODY


@pytest.mark.parametrize("python", [
    pytest.param(sys.executable, id="root-daemon"),
    # The shipped unit's daemon (uid 1, ambient caps) has no DAC capability: the worker's
    # interpreter must be one the worker user can reach (this venv's is under /root).
    pytest.param(SYSTEM_PYTHON, id="capable-daemon",
                 marks=pytest.mark.skipif(not os.path.exists(SYSTEM_PYTHON), reason="no system python"))])
def test_the_launcher_runs_a_cold_worker_as_its_user_with_no_capability(open_dir, python):
    (open_dir / "r.py").write_text(REPORT)
    prefix = [] if python == sys.executable else AS_DAEMON_USER
    launcher = [python, "-m", "elasticd.contract.identity", python, "r.py"]
    out = subprocess.run([*prefix, *launcher], cwd=open_dir, check=True, text=True,
                         capture_output=True, env=_env(**{WORKER_USER_VAR: NOBODY.encode()}))
    _as_worker(json.loads(out.stdout))


def test_without_a_worker_user_the_launcher_only_execs(open_dir):
    (open_dir / "r.py").write_text(REPORT)
    out = subprocess.run([sys.executable, "-m", "elasticd.contract.identity", sys.executable,
                          "r.py"], cwd=open_dir, check=True, text=True, capture_output=True,
                         env=_env())
    assert json.loads(out.stdout)["uid"] == [0, 0, 0]


@pytest.mark.process
def test_a_warm_worker_and_its_cold_fallback_run_as_their_user(open_dir):
    """The server's forked child switches in process (ids, groups, every capability set
    emptied; checked), the agent the daemon forks there does not, and a client that finds
    no server switches before its cold start."""
    (open_dir / "r.py").write_text(REPORT)
    sock = open_dir / "warm.sock"
    # What the script needs is imported before the fork (the server's preload), as a real
    # server imports torch and the trainer: this venv's own library is under /root.
    server = subprocess.Popen([sys.executable, "-m", "elasticd.warmstart", "--serve", str(sock),
                               "json", "pkgutil", "elasticd.contract.identity"],
                              cwd=open_dir, env=_env())
    try:
        assert proctree.wait_for(sock.exists, 60), "the server never listened"
        env = _env(**{WORKER_USER_VAR: NOBODY.encode()})
        for where in (sock, open_dir / "absent.sock"):
            out = subprocess.run([sys.executable, "-m", "elasticd.warmstart", str(where), "r.py"],
                                 cwd=open_dir, env=env, text=True, capture_output=True, check=True)
            report = json.loads(out.stdout)
            _as_worker(report)
            assert report["cwd"] == str(open_dir)
        # The daemon's agent: no user asked, none taken.
        reader, writer = os.pipe()
        child = spawn(sock, [str(open_dir / "r.py")], env, [os.open(os.devnull, os.O_RDONLY), writer, writer])
        os.close(writer)
        assert child.wait(30) == 0
        assert json.loads(os.read(reader, 4096))["uid"] == [0, 0, 0]
    finally:
        proctree.kill_tree(server.pid)
        server.wait()


def test_a_daemon_that_cannot_switch_is_told_what_it_lacks():
    out = subprocess.run([SETPRIV, "--reuid=1", "--regid=1", "--clear-groups", sys.executable,
                          "-c", "from elasticd.contract.identity import *; "
                          "print(switch_refusal(resolve('nobody')))"],
                         env=_env(), text=True, capture_output=True, check=True).stdout
    assert "CAP_KILL, CAP_SETGID, CAP_SETUID" in out and "AmbientCapabilities" in out
    assert switch_refusal(NOBODY) is None   # root


def _config(tmp: Path, ckpt: Path, secret: Path | None = None):
    path = write_config(tmp / "n.toml", job="j", node="n", endpoint="127.0.0.1:2379",
                        run_dir=tmp / "run", ckpt_dir=ckpt, secret_file=secret,
                        worker_user="nobody")
    return load_config(str(path))


def test_the_daemon_refuses_a_checkpoint_dir_or_secret_the_workers_cannot_use(open_dir):
    private = open_dir / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=r"\[checkpoint\] dir.*cannot write.*chgrp 65534"):
        check_worker_user(_config(open_dir, private / "ckpt"))
    shared = open_dir / "ckpt"
    shared.mkdir()
    share(shared, NOBODY)
    secret = open_dir / "job.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    with pytest.raises(ConfigError, match=r"\[recovery\] secret_file.*cannot read.*g\+r"):
        check_worker_user(_config(open_dir, shared, secret))
    os.chown(secret, -1, NOBODY.gid)
    secret.chmod(0o640)
    # A checkpoint dir not made yet is the workers' to make where they can write its parent.
    assert check_worker_user(_config(open_dir, shared / "not-yet", secret)) == NOBODY
    config = _config(open_dir, shared, secret)
    unset = dataclasses.replace(config, job=dataclasses.replace(config.job, worker_user=""))
    assert check_worker_user(unset) is None


def test_a_worker_group_without_a_worker_user_is_refused(tmp_path):
    path = write_config(tmp_path / "n.toml", job="j", node="n", endpoint="127.0.0.1:2379",
                        run_dir=tmp_path, ckpt_dir=tmp_path, sections="")
    text = path.read_text().replace('worker_user = ""', 'worker_user = ""\nworker_group = "nogroup"')
    path.write_text(text)
    with pytest.raises(ConfigError, match="job.worker_group"):
        load_config(str(path))


def test_a_shared_dir_is_the_workers_to_write_but_not_to_rename_the_daemons_files(open_dir):
    shared = open_dir / "run"
    shared.mkdir()
    share(shared, NOBODY)
    (shared / "warm.sock").write_text("the daemon's")
    assert worker_can(NOBODY, str(shared), "rwx")
    mine = subprocess.run([SETPRIV, f"--reuid={NOBODY.uid}", f"--regid={NOBODY.gid}",
                           "--clear-groups", "mv", str(shared / "warm.sock"), str(shared / "x")],
                          capture_output=True, text=True, check=False)
    assert mine.returncode != 0 and "not permitted" in mine.stderr   # the sticky bit


def test_write_atomic_does_not_follow_a_planted_symlink(open_dir):
    """The old temp name was predictable (``PATH.tmp.PID``): a worker could plant a
    symlink there and have the daemon (root) write through it."""
    victim = open_dir / "victim"
    victim.write_text("untouched")
    target = open_dir / "generation.json"
    (open_dir / f"generation.json.tmp.{os.getpid()}").symlink_to(victim)
    old = os.umask(0o027)
    try:
        write_atomic(target, "{}")
    finally:
        os.umask(old)
    assert victim.read_text() == "untouched" and target.read_text() == "{}"
    assert target.stat().st_mode & 0o777 == 0o640
    assert not [p for p in open_dir.iterdir() if p.name.startswith(".generation")]
