"""The job's secret (``elasticd.contract.secret``): what makes a file usable, what a
member's proof binds, and a daemon that refuses to start on an unusable one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elasticd.contract.secret import MIN_BYTES, SecretError, proof, read_secret
from elasticd.lab.local_cluster import write_config


def _file(tmp_path, data: bytes = b"k" * 32, mode: int = 0o600):
    path = tmp_path / "job.secret"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_private_file_of_enough_bytes_is_the_secret(tmp_path):
    assert read_secret(str(_file(tmp_path))) == b"k" * 32


@pytest.mark.parametrize(("make", "said"), [
    (lambda p: _file(p, mode=0o644), "chmod 600"),
    (lambda p: _file(p, b"short"), f"fewer than {MIN_BYTES}"),
    (lambda p: p / "missing", "cannot be read"),
    (lambda p: p, "not a regular file"),
])
def test_an_unusable_file_names_the_problem_and_the_fix(tmp_path, make, said):
    with pytest.raises(SecretError, match=said):
        read_secret(str(make(tmp_path)))


def test_a_proof_binds_the_secret_the_generation_the_store_the_rank_and_the_node():
    base = proof(b"s" * 16, "3.1", "h:1", 0, "a")
    assert len(base) == 32 and base == proof(b"s" * 16, "3.1", "h:1", 0, "a")
    for other in (proof(b"t" * 16, "3.1", "h:1", 0, "a"), proof(b"s" * 16, "3.2", "h:1", 0, "a"),
                  proof(b"s" * 16, "3.1", "h:2", 0, "a"), proof(b"s" * 16, "3.1", "h:1", 1, "a"),
                  proof(b"s" * 16, "3.1", "h:1", 0, "b")):
        assert other != base


def test_the_daemon_does_not_start_on_an_unusable_secret_file(tmp_path):
    secret = _file(tmp_path, mode=0o644)
    config = write_config(tmp_path / "node.toml", job="j", node="a", endpoint="127.0.0.1:1",
                          run_dir=tmp_path / "run", ckpt_dir=tmp_path / "ckpt",
                          secret_file=secret)
    done = subprocess.run([sys.executable, "-m", "elasticd", "run", "--config", str(config)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert done.returncode != 0
    assert f"chmod 600 {secret}" in done.stderr + done.stdout, done.stderr[-2000:]
