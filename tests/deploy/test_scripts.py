"""The shell scripts in deploy/: strict mode, a usage line, valid syntax (shellcheck where
installed), and clear refusals of bad input. Their real work is tested elsewhere:
cluster.sh and setup-auth.sh in test_etcd_cluster.py, make-certs.sh in test_configs.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.deploy.conftest import DEPLOY

SCRIPTS = sorted(DEPLOY.rglob("*.sh"))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30,
                          env=env if env is not None else {"PATH": os.environ.get("PATH", "")})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_is_strict_and_says_how_to_call_it(script):
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    assert "usage" in text.lower()
    assert os.access(script, os.X_OK), f"chmod +x {script}"
    assert run("bash", "-n", str(script)).returncode == 0


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck():
    done = run("shellcheck", *map(str, SCRIPTS))
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("args, message", [
    ([], "usage: cluster.sh"),
    (["OUT"], "usage: cluster.sh"),
    (["OUT", "m1"], "bad member 'm1'"),
    (["OUT", "M1=10.0.0.1"], "bad member"),
    (["OUT", "m1=10.0.0.1:2379"], "bad member"),
    (["OUT", "m1=10.0.0.1", "m1=10.0.0.2", "m2=10.0.0.3"], "names must be unique"),
])
def test_cluster_sh_refuses_bad_members(args, message, tmp_path):
    out = str(tmp_path / "o")
    done = run("bash", str(DEPLOY / "etcd/cluster.sh"), *[a.replace("OUT", out) for a in args])
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert not (tmp_path / "o").exists()


def test_setup_auth_needs_both_passwords_and_the_tls_files(tmp_path):
    script = str(DEPLOY / "etcd/setup-auth.sh")
    base = {"PATH": os.environ.get("PATH", "")}
    passwords = {**base, "ETCD_ROOT_PASSWORD": "r", "ELASTICD_ETCD_PASSWORD": "e"}
    done = run("bash", script, "127.0.0.1:2379", str(tmp_path), "job-a", env=base)
    assert done.returncode != 0 and "usage:" in done.stderr
    done = run("bash", script, "127.0.0.1:2379", str(tmp_path), env=passwords)
    assert done.returncode != 0 and "usage:" in done.stderr and "JOB" in done.stderr
    done = run("bash", script, "127.0.0.1:2379", str(tmp_path), "Job A", env=passwords)
    assert done.returncode == 2 and "job id 'Job A' is not valid" in done.stderr
    done = run("bash", script, "127.0.0.1:2379", str(tmp_path), "job-a", env=passwords)
    assert done.returncode == 2 and "ca.pem is missing" in done.stderr


def test_cloud_init_sync_check_passes():
    done = run(sys.executable, str(DEPLOY / "cloud-init/sync.py"), "--check")
    assert done.returncode == 0, done.stderr
