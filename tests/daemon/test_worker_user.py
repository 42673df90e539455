"""Issue 27, deliverable 4: the training code runs as a Unix user of its own and cannot
read what gives the daemon its power over the job's etcd prefix.

Three real daemons (two with warm starts, one cold: both launch paths) with ``[job]
worker_user = "nobody"``, real torchrun, gloo, float64; the files laid out as the shipped
unit does (deploy/README.md): the key files and the env file with the etcd password
root-owned, mode 0640, group the daemon's keys group; the job's secret and the
checkpoint directory the workers' group's. Each worker first tries to read them and its
daemon's and parent's memory and environment (tests/workers/peek.py), then trains; a
node is SIGKILLed and the survivors re-form in place as that user; the run matches the
replay oracle.

Two daemons: root, and the shipped unit's (``User=`` uid 1, ``Group=`` the workers'
group, ``SupplementaryGroups=`` the keys' group, the three ambient capabilities, through
``setpriv``). That one runs the system interpreter with this venv's packages on
``PYTHONPATH``: this venv's interpreter lives under /root, which uid 1 cannot enter.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from elasticd.contract.identity import SETPRIV, capabilities, resolve, share
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

# In `make test` (not the in-place lane): the shipped set-up's guarantee, checked by CI.
pytestmark = [pytest.mark.process,
              pytest.mark.skipif(os.geteuid() != 0, reason="the daemon must be able to switch users")]

PEEK = str(Path(__file__).resolve().parents[1] / "workers" / "peek.py")
REPO = Path(__file__).resolve().parents[2]
WORKER = "nobody"
SYSTEM_PYTHON = "/usr/bin/python3"
DAEMON_UID = KEYS_GID = 1   # Debian's "daemon" user and group
CAPS = "+kill,+setgid,+setuid"


class UnitDaemon(DaemonNode):
    """A daemon as the shipped unit runs it: not root, the workers' group as its own, the
    keys' group beside it, CAP_SETUID, CAP_SETGID and CAP_KILL in its ambient set."""

    def command(self) -> list[str]:
        return [SYSTEM_PYTHON, "-m", "elasticd", "run", "--config", str(self.config_path)]

    def environment(self) -> dict[str, str]:
        site = REPO / ".venv" / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
        return {**super().environment(), "PYTHONPATH": f"{site}:{REPO}", "HOME": str(self.root)}


@pytest.fixture
def root(open_dir) -> Path:
    """A cluster root the worker user can enter (``open_dir``, tests/conftest.py)."""
    return open_dir


def _shipped_layout(root: Path, keys_gid: int = 0) -> tuple[list[Path], Path]:
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
        os.chown(path, -1, keys_gid)
        path.chmod(0o640)
    os.chown(etc, -1, keys_gid)
    secret = job_secret(root)
    os.chown(secret, -1, worker.gid)
    secret.chmod(0o640)
    for name in ("ckpt", "peek"):
        (root / name).mkdir()
        share(root / name, worker, sticky=False)
    if keys_gid:   # the checkpoint dir is the daemon's user's, as deploy/README.md makes it
        os.chown(root / "ckpt", DAEMON_UID, -1)
    return credentials, root / "peek"


@pytest.mark.parametrize("daemon", [
    "root", pytest.param("unit", marks=pytest.mark.skipif(
        not os.path.exists(SYSTEM_PYTHON), reason="needs a system python 3 the daemon's user can run"))])
def test_workers_run_as_their_own_user_and_cannot_read_the_daemons_credentials(root, job_id,
                                                                              etcd_server, daemon):
    worker = resolve(WORKER)
    unit = daemon == "unit"
    credentials, peek = _shipped_layout(root, KEYS_GID if unit else 0)
    env = {"PEEK_PATHS": os.pathsep.join(map(str, credentials)), "PEEK_DIR": str(peek)}
    final = 90
    nodes: list[DaemonNode] = []

    def start(name: str) -> DaemonNode:
        kind, kw = DaemonNode, {}
        if unit:
            kind, kw = UnitDaemon, {"prefix": [
                SETPRIV, f"--reuid={DAEMON_UID}", f"--regid={worker.gid}", f"--groups={KEYS_GID}",
                f"--inh-caps={CAPS}", f"--ambient-caps={CAPS}", "--"]}
            # The unit's RuntimeDirectory: made for the daemon's user before it starts.
            (root / name).mkdir()
            os.chown(root / name, DAEMON_UID, worker.gid)
        config = {"entrypoint": entry(final, PEEK), "every_steps": 10, "min_nodes": 3,
                  "worker_user": WORKER, "warm_start": name != "c",
                  "python": SYSTEM_PYTHON if unit else ""}
        node = kind(name, etcd_server.endpoint, job_id, root, config, env, **kw).start()
        nodes.append(node)
        return node

    try:
        three = world_of_three(start)
        # The daemon, its warm server, agent and clients are the daemon's user; the
        # workers, and they alone, the worker user.
        for node in three:
            uids = {p.uids().real for p in node.tree()}
            assert uids == {DAEMON_UID if unit else 0, worker.uid}, (node.name, uids)
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
