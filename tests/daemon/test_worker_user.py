"""Issue 27, deliverable 4: the training code runs as a Unix user of its own and cannot
read what gives the daemon its power over the job's etcd prefix.

Three real daemons (two with warm starts, one cold: both launch paths) with ``[job]
worker_user = "nobody"``, real torchrun, gloo, float64; the files laid out as the shipped
unit does (deploy/README.md): the key files and the env file with the etcd password
root-owned, mode 0640, group the daemon's; the job's secret and the checkpoint directory
the workers' group's. Each worker first tries to read them and its daemon's and parent's
memory and environment (tests/workers/peek.py), then trains; a node is SIGKILLed and the
survivors re-form in place as that user; the run matches the replay oracle.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.contract.identity import capabilities, resolve, share
from elasticd.lab.local_cluster import job_secret
from elasticd.ops.doctor import DIR_ID_FILE
from tests.daemon.runs import (
    by_rank,
    completed,
    entry,
    lose_one,
    matches_the_replay,
    progress_records,
    world_of_three,
)
from tests.daemon_nodes import DaemonNode, agent_events, stop_nodes

pytestmark = [pytest.mark.inplace,
              pytest.mark.skipif(os.geteuid() != 0, reason="the daemon must be able to switch users")]

PEEK = str(Path(__file__).resolve().parents[1] / "workers" / "peek.py")
WORKER = "nobody"


@pytest.fixture
def root() -> Iterator[Path]:
    """A cluster root the worker user can enter (pytest's tmp_path sits in a 0700 dir)."""
    path = Path(tempfile.mkdtemp(prefix="elasticd-worker-user-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _shipped_layout(root: Path) -> tuple[list[Path], Path]:
    """/etc/elasticd as deploy/README.md lays it out (here the daemon's group is root's):
    the credential files, and the job's secret readable by the workers' group; the
    checkpoint and peek directories theirs to write. Returns (credentials, peek dir)."""
    worker = resolve(WORKER)
    etc = root / "etc"
    etc.mkdir(mode=0o750)
    credentials = [etc / "client-key.pem", etc / "elasticd.env"]
    credentials[0].write_text("-----BEGIN PRIVATE KEY-----\nnot a real key\n")
    credentials[1].write_text("ELASTICD_ETCD_PASSWORD=hunter2\n")
    for path in credentials:
        path.chmod(0o640)
    secret = job_secret(root)
    os.chown(secret, -1, worker.gid)
    secret.chmod(0o640)
    for name in ("ckpt", "peek"):
        (root / name).mkdir()
        share(root / name, worker, sticky=False)
    return credentials, root / "peek"


def test_workers_run_as_their_own_user_and_cannot_read_the_daemons_credentials(root, job_id,
                                                                              etcd_server):
    credentials, peek = _shipped_layout(root)
    worker = resolve(WORKER)
    env = {"PEEK_PATHS": os.pathsep.join(map(str, credentials)), "PEEK_DIR": str(peek)}
    final = 90
    nodes: list[DaemonNode] = []

    def start(name: str) -> DaemonNode:
        node = DaemonNode(name, etcd_server.endpoint, job_id, root, {
            "entrypoint": entry(final, PEEK), "every_steps": 10, "min_nodes": 3,
            "worker_user": WORKER, "warm_start": name != "c"}, env=env).start()
        nodes.append(node)
        return node

    try:
        three = world_of_three(start)
        victim, survivors, crash = lose_one(three, nodes, rank0=True)
        completed(survivors)
        reports = {int(p.stem): json.loads(p.read_text()) for p in peek.glob("*.json")}
        # Every worker that ever started: the three (the loss is in place), or more if the
        # world of 3 formed through a restart at start-up.
        assert len(reports) >= 3, reports
        for report in reports.values():
            assert report["uid"] == [worker.uid] * 3 and report["gid"] == [worker.gid] * 3
            assert report["caps"] == 0, report
            denied = {path: how for path, how in report["tried"].items() if how != "read"}
            assert denied == report["tried"], report["tried"]
            assert set(denied.values()) == {"PermissionError"}, report["tried"]
        # The survivors re-formed in place, their workers never restarted, and rank 0
        # (as the worker user) committed checkpoints the replay bears out.
        for node in survivors:
            assert len(agent_events(node, "reformed")) == 1, node.log_tail()
            assert not [r for r in progress_records(node)
                        if r["event"] == "resumed" and r["time"] > crash]
        matches_the_replay(by_rank(survivors, True), root / "ckpt", final)
        # Every checkpoint file is the workers' (the directory's id file is the daemons').
        owners = {str(p.relative_to(root)): p.stat().st_uid
                  for p in (root / "ckpt").rglob("*") if p.is_file() and p.name != DIR_ID_FILE}
        assert set(owners.values()) == {worker.uid}, owners
        assert victim.name not in {n.name for n in survivors}
    finally:
        stop_nodes(nodes)


def test_the_launcher_leaves_a_cold_worker_no_capability(tmp_path):
    """What torchrun runs for a cold worker: the launcher switches, then execs."""
    import subprocess
    import sys

    worker = resolve(WORKER)
    out = subprocess.run(
        [sys.executable, "-m", "elasticd.contract.identity", "/bin/sh", "-c",
         "id -u; id -g; grep CapEff /proc/self/status"],
        env={**os.environ, "ELASTICD_WORKER_USER": worker.encode()},
        capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == [str(worker.uid), str(worker.gid)]
    assert int(out[2].split()[1], 16) == 0
    assert capabilities() != 0   # the test itself (root) kept its own
