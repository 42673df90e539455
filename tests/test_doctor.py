"""`elasticd doctor`: every check passes on a healthy local setup, and each failure an
operator meets before joining a node gives its own FAIL line (real etcd servers)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from elasticd.cli import main
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.lab.embedded_etcd import free_port
from elasticd.lab.local_cluster import job_secret
from elasticd.ops import doctor
from tests.conftest import etcdctl


def write_config(tmp_path: Path, endpoint: str, job_id: str, node: str = "node-a",
                 ckpt: Path | str | None = None, extra: str = "", name: str | None = None) -> Path:
    ckpt = ckpt if ckpt is not None else tmp_path / "ckpt"
    path = tmp_path / (name or f"{node}.toml")
    path.write_text(f"""
[job]
id = "{job_id}"
entrypoint = ["train.py"]

[etcd]
endpoints = ["{endpoint}"]
{extra}
[node]
id = "{node}"

[checkpoint]
dir = "{ckpt}"
""")
    return path


def run(config: Path) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["doctor", "--config", str(config)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output.splitlines()


def lines_with(lines: list[str], status: str) -> list[str]:
    return [line for line in lines if line.split(" ", 1)[0] == status]


def test_healthy_local_setup_every_line_ok(etcd_server, job_id, tmp_path):
    port = free_port()
    config = write_config(tmp_path, etcd_server.endpoint, job_id)
    secret = job_secret(tmp_path)
    config.write_text(config.read_text() + f'\n[metrics]\nport = {port}\n'
                      f'[recovery]\nsecret_file = "{secret}"\n')
    code, lines = run(config)
    assert code == 0, "\n".join(lines)
    # Every line ok but the worker user's (tests/daemon/test_identity.py sets one up: it
    # needs directories outside pytest's 0700 tmp_path).
    assert lines and all(line.startswith("ok ") or "no [job] worker_user" in line
                         for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    for expected in ("config", f"etcd {etcd_server.endpoint}", f"/elasticd/{job_id}/doctor/node-a",
                     "writable", "GiB free", "checkpoint dir the same on every node", "clock:",
                     "torch 2.", "CUDA", "node addr 127.0.0.1", f"metrics port 127.0.0.1:{port} is free",
                     "torchrun.handlers:etcd3", f"the job's secret {secret} is usable"):
        assert expected in text, (expected, text)
    # The id file was made, and the record published with it on a lease.
    dir_id = (tmp_path / "ckpt" / doctor.DIR_ID_FILE).read_text().strip()
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    try:
        kv = client.get(f"/elasticd/{job_id}/doctor/node-a")
        record = json.loads(kv.value)
        assert record["dir_id"] == dir_id and record["node"] == "node-a"
        assert 0 < client.lease_ttl(kv.lease_id) <= doctor.RECORD_TTL_S
        # A second run (ExecStartPre on every restart) keeps the id and reuses the lease.
        code, lines = run(config)
        assert code == 0, "\n".join(lines)
        again = client.get(f"/elasticd/{job_id}/doctor/node-a")
        assert again.lease_id == kv.lease_id
        assert json.loads(again.value)["dir_id"] == dir_id
        assert any(f"id {dir_id} (read from" in line for line in lines)
    finally:
        client.close()
    # Nothing but the id file is left in the checkpoint dir.
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == [doctor.DIR_ID_FILE]


def test_the_jobs_secret_missing_is_a_warning_and_unusable_a_failure(etcd_server, job_id, tmp_path):
    config = write_config(tmp_path, etcd_server.endpoint, job_id)
    code, lines = run(config)
    assert code == 0 and any("no [recovery] secret_file" in w for w in lines_with(lines, "warn")), lines
    secret = job_secret(tmp_path)
    secret.chmod(0o644)
    config.write_text(config.read_text() + f'[recovery]\nsecret_file = "{secret}"\n')
    code, lines = run(config)
    failed = lines_with(lines, "FAIL")
    assert code != 0 and len(failed) == 1 and f"chmod 600 {secret}" in failed[0], lines


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root here")
def test_no_worker_user_is_a_warning_and_one_that_cannot_write_checkpoints_a_failure(
        etcd_server, job_id, tmp_path):
    config = write_config(tmp_path, etcd_server.endpoint, job_id)
    code, lines = run(config)
    assert code == 0 and any("no [job] worker_user" in w for w in lines_with(lines, "warn")), lines
    # pytest's tmp_path is in a 0700 directory: nobody cannot reach the checkpoint dir.
    config.write_text(config.read_text().replace("[job]\n", '[job]\nworker_user = "nobody"\n', 1))
    code, lines = run(config)
    failed = lines_with(lines, "FAIL")
    assert code != 0 and len(failed) == 1, lines
    assert "[checkpoint] dir" in failed[0] and "cannot write" in failed[0] and "chgrp" in failed[0]


def test_config_error_is_one_fail_line(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[job]\nid = "Bad Id"\nentrypoint = ["train.py"]\n')
    code, lines = run(config)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1, lines
    assert "job id 'Bad Id' is not valid" in failed[0] and "-> fix:" in failed[0]


@pytest.mark.process
def test_unreachable_etcd_names_the_endpoints_and_fails_fast(job_id, tmp_path):
    dead = f"127.0.0.1:{free_port()}"
    config = write_config(tmp_path, dead, job_id)
    doctor.run_doctor(config)   # torch imported once, so the time below is etcd's
    started = time.monotonic()
    checks = doctor.run_doctor(config)
    elapsed = time.monotonic() - started
    failed = [c for c in checks if c.failed]
    assert len(failed) == 1, [c.line() for c in checks]
    assert failed[0].what.startswith("etcd unreachable") and dead in failed[0].what
    assert "endpoints" in failed[0].fix
    assert elapsed < doctor.ETCD_TIMEOUT_S + 5, elapsed
    # The checkpoint dir is still checked locally; the cross-node comparison is skipped.
    assert any(c.status == "warn" and "not compared" in c.what for c in checks)
    assert doctor.exit_code(checks) == 1


@pytest.fixture
def doctor_auth_etcd(fresh_etcd):
    etcdctl(fresh_etcd, "user", "add", "root:rootpw")
    etcdctl(fresh_etcd, "user", "add", "elasticd-other:otherpw")
    etcdctl(fresh_etcd, "role", "add", "elasticd-other")
    etcdctl(fresh_etcd, "role", "grant-permission", "elasticd-other", "--prefix=true", "readwrite",
             "/elasticd/other-job/")
    etcdctl(fresh_etcd, "user", "grant-role", "elasticd-other", "elasticd-other")
    etcdctl(fresh_etcd, "auth", "enable")
    return fresh_etcd


def auth_extra(user: str, password: str) -> str:
    return f'user = "{user}"\npassword = "{password}"\n'


@pytest.mark.process
def test_bad_credentials_and_missing_permission(doctor_auth_etcd, job_id, tmp_path):
    wrong = write_config(tmp_path, doctor_auth_etcd.endpoint, job_id, extra=auth_extra("root", "wrong"),
                         name="wrong.toml")
    code, lines = run(wrong)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1, lines
    assert failed[0].startswith("FAIL etcd credentials") and "rejected user 'root'" in failed[0]
    assert f"/elasticd/{job_id}/" in failed[0] and "password" in failed[0]
    # Plaintext credentials are worth a warning line, not a log line between the checks.
    assert any(line.startswith("warn") and "plaintext" in line for line in lines), lines

    other = write_config(tmp_path, doctor_auth_etcd.endpoint, job_id,
                         extra=auth_extra("elasticd-other", "otherpw"), name="other.toml")
    code, lines = run(other)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1, lines
    assert failed[0].startswith("FAIL etcd permission: user 'elasticd-other' may not read keys "
                                f"under /elasticd/{job_id}/"), failed[0]
    assert "setup-auth.sh" in failed[0]

    anonymous = write_config(tmp_path, doctor_auth_etcd.endpoint, job_id, name="anonymous.toml")
    code, lines = run(anonymous)
    assert code == 1
    assert "no [etcd] user is set" in "\n".join(lines_with(lines, "FAIL"))

    good = write_config(tmp_path, doctor_auth_etcd.endpoint, job_id, extra=auth_extra("root", "rootpw"),
                        name="good.toml")
    code, lines = run(good)
    assert code == 0 and not lines_with(lines, "FAIL"), lines
    assert any("user 'root'" in line and line.startswith("ok") for line in lines)


def test_checkpoint_dir_that_cannot_be_created(etcd_server, job_id, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = write_config(tmp_path, etcd_server.endpoint, job_id, ckpt=blocker / "ckpt")
    code, lines = run(config)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1, lines
    assert f"checkpoint dir {blocker / 'ckpt'} does not exist and cannot be created" in failed[0]
    assert "mount the shared storage" in failed[0]


def test_run_refuses_a_checkpoint_dir_that_doctor_fails_before_starting_anything(tmp_path):
    """Before: `elasticd run` started, the workers failed to create the directory, and after
    five crashes the node was "marked failed" with the cause in agent.log. Now run stops at
    once with doctor's line and fix (exit 1), before it registers in etcd or starts an agent
    (the endpoint here has no etcd at all)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = write_config(tmp_path, f"127.0.0.1:{free_port()}", "job-x", ckpt=blocker / "ckpt")
    started = time.monotonic()
    result = CliRunner().invoke(main, ["run", "--config", str(config)])
    assert result.exit_code == 1, result.output
    assert f"cannot run: checkpoint dir {blocker / 'ckpt'} does not exist and cannot be created" \
        in result.output and "fix: mount the shared storage" in result.output
    assert time.monotonic() - started < 10


@contextlib.contextmanager
def read_only_tmpfs(path: Path):
    path.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True, timeout=30)


def test_checkpoint_dir_on_a_read_only_file_system(etcd_server, job_id, tmp_path):
    with read_only_tmpfs(tmp_path / "ro") as ro:
        config = write_config(tmp_path, etcd_server.endpoint, job_id, ckpt=ro)
        code, lines = run(config)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1, lines
    assert f"checkpoint dir {ro} is not writable" in failed[0] and "Read-only file system" in failed[0]


def test_two_nodes_with_different_checkpoint_dirs(etcd_server, job_id, tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "local-of-b"
    a = write_config(tmp_path, etcd_server.endpoint, job_id, node="node-a", ckpt=shared)
    b = write_config(tmp_path, etcd_server.endpoint, job_id, node="node-b", ckpt=local)
    c = write_config(tmp_path, etcd_server.endpoint, job_id, node="node-c", ckpt=shared)
    assert run(a)[0] == 0
    code, lines = run(b)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1, lines
    assert "node node-a sees a different checkpoint directory" in failed[0]
    assert f"mount the shared storage at {local}" in failed[0]
    # A node on the same storage agrees with node-a (and names node-b's mismatch too).
    code, lines = run(c)
    assert code == 1
    text = "\n".join(lines)
    assert "node node-b sees a different checkpoint directory" in text
    assert "node node-a sees" not in text
    # Once node-b mounts the shared storage, every node agrees.
    b.write_text(b.read_text().replace(str(local), str(shared)))
    code, lines = run(b)
    assert code == 0, "\n".join(lines)
    assert any("node-a, node-c published the same id" in line for line in lines), lines


def test_a_peer_clock_ahead_is_a_warning(etcd_server, job_id, tmp_path):
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    config = write_config(tmp_path, etcd_server.endpoint, job_id)
    try:
        assert run(config)[0] == 0
        dir_id = (tmp_path / "ckpt" / doctor.DIR_ID_FILE).read_text().strip()
        client.put(f"/elasticd/{job_id}/doctor/node-z",
                   json.dumps({"node": "node-z", "dir_id": dir_id, "time": time.time() + 60}).encode())
        code, lines = run(config)
    finally:
        client.close()
    assert code == 0, lines
    warned = [w for w in lines_with(lines, "warn") if "secret_file" not in w
              and "worker_user" not in w]
    assert len(warned) == 1 and re.search(r"records in our future: node-z by (59|60)\.\d s", warned[0]), lines
    assert "NTP" in warned[0]


def test_node_addr_not_local_and_metrics_port_taken(etcd_server, job_id, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = write_config(tmp_path, etcd_server.endpoint, job_id)
        config.write_text(config.read_text().replace('id = "node-a"', 'id = "node-a"\naddr = "192.0.2.7"')
                          + f"\n[metrics]\nport = {port}\n")
        code, lines = run(config)
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 2, lines
    assert failed[0].startswith("FAIL node addr 192.0.2.7 cannot be bound") and "[node] addr" in failed[0]
    assert failed[1].startswith(f"FAIL metrics port 127.0.0.1:{port} cannot be bound")


def test_entry_point_missing(monkeypatch):
    monkeypatch.setattr(doctor.metadata, "entry_points", lambda group: [])
    check = doctor._entry_point_check(None)
    assert check.failed and "torchrun.handlers:etcd3 is not registered" in check.what
    assert "pip install elasticd" in check.fix


def test_entry_point_in_job_python(tmp_path):
    bare, full = tmp_path / "bare-python", tmp_path / "full-python"
    # No site-packages, and not run from the repository (whose egg-info registers it).
    bare.write_text(f'#!/bin/sh\ncd /\nexec {sys.executable} -S "$@"\n')
    full.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for script in (bare, full):
        script.chmod(0o755)
    missing = doctor._entry_point_check(str(bare))
    assert missing.failed and "not registered" in missing.what and str(bare) in missing.what
    found = doctor._entry_point_check(str(full))
    assert not found.failed and "elasticd.rendezvous:handler_factory" in found.what
    gone = doctor._entry_point_check(str(tmp_path / "nonexistent"))
    assert gone.failed and "[job] python" in gone.what


def test_malformed_dir_id_file(etcd_server, job_id, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / doctor.DIR_ID_FILE).write_text("hello\n")
    code, lines = run(write_config(tmp_path, etcd_server.endpoint, job_id))
    assert code == 1
    failed = lines_with(lines, "FAIL")
    assert len(failed) == 1 and doctor.DIR_ID_FILE in failed[0] and "delete" in failed[0], lines


def test_a_bucket_checkpoint_dir_is_checked_as_a_bucket(etcd_server, job_id, tmp_path, bucket,
                                                        object_store):
    """Issue 28: [checkpoint] dir = s3://...: reachable, writable, listable, its id object
    made once and read after; a bucket that does not exist fails with the fix. Nothing is
    made on the local disk."""
    config = write_config(tmp_path, etcd_server.endpoint, job_id, ckpt=bucket)
    code, lines = run(config)
    assert code == 0, "\n".join(lines)
    text = "\n".join(lines)
    assert f"checkpoint bucket {bucket}: reachable, writable (put, read back, delete), listable" in text
    made = next(line for line in lines if "checkpoint dir id" in line)
    assert "made now" in made
    code, lines = run(config)
    assert code == 0 and any("checkpoint dir id" in x and "read from" in x for x in lines), lines
    assert not (Path.cwd() / "s3:").exists()
    missing = write_config(tmp_path, etcd_server.endpoint, job_id, ckpt="s3://no-such-bucket-x/ckpt",
                           name="missing.toml")
    code, lines = run(missing)
    failed = lines_with(lines, "FAIL")
    assert code != 0 and len(failed) == 1 and "create the bucket" in failed[0], lines
