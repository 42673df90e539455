"""``elasticd doctor``: the preflight an operator runs before joining a node to a job.

One line per check, ``ok`` / ``warn`` / ``FAIL``, what was checked and, for a failure,
how to fix it; the command exits non-zero on any failure. Every check is bounded in
time (etcd calls end within ``ETCD_TIMEOUT_S``), so the systemd unit can run it as
``ExecStartPre``.

Checks, in order: the config loads; etcd answers a read, a write and a delete under
the job's prefix with the configured TLS and credentials; the checkpoint directory
exists (or can be created) and is writable, and is the same directory on every node
(an id file in it, compared through etcd); the node's clock against the other nodes'
published records; torch and the private APIs the rendezvous plugin needs; the node
address and the metrics port; the torchrun ``etcd3`` entry point.

"The same on every node": the directory holds ``.elasticd-dir-id`` (a random id, made
atomically by the first node that finds none). Each doctor run publishes
``{node, dir_id, dir, time}`` at ``<prefix>/<job>/doctor/<node>`` on a 1 h lease and
compares its id with the ids the other nodes published: a node that sees another id
mounted different storage (or none) at ``checkpoint.dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from elasticd.errors import ConfigError, EtcdAuthError, EtcdError, EtcdUnavailable

ETCD_TIMEOUT_S = 3.0          # every etcd step (connect, read, write, delete) ends by then
RECORD_TTL_S = 3600           # the published doctor record lives this long after the last run
CLOCK_AHEAD_WARN_S = 2.0
LOW_SPACE_WARN_BYTES = 1 << 30
DIR_ID_FILE = ".elasticd-dir-id"
ENTRY_POINT_GROUP = "torchrun.handlers"
ENTRY_POINT_NAME = "etcd3"
_SUBPROCESS_TIMEOUT_S = 20.0  # the entry-point check in job.python's interpreter


@dataclass(frozen=True)
class Check:
    status: str              # "ok" | "warn" | "FAIL"
    what: str                # what was checked, and what was found
    fix: str = ""            # for a failure (or a warning): what to do

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"

    def line(self) -> str:
        text = f"{self.status:<4} {self.what}"
        return f"{text} -> fix: {self.fix}" if self.fix else text


def ok(what: str) -> Check:
    return Check("ok", what)


def warn(what: str, fix: str = "") -> Check:
    return Check("warn", what, fix)


def fail(what: str, fix: str) -> Check:
    return Check("FAIL", what, fix)


def run_doctor(config_path: str | os.PathLike[str], env: dict[str, str] | None = None,
               echo: Callable[[str], None] | None = None,
               clock: Callable[[], float] = time.time) -> list[Check]:
    """Run every check; ``echo`` gets each line as soon as its check is done."""
    checks: list[Check] = []

    def report(check: Check) -> None:
        checks.append(check)
        if echo is not None:
            echo(check.line())

    with _captured_warnings(report):
        _run(Path(config_path), env, report, clock)
    return checks


def _run(path: Path, env: dict[str, str] | None, report: Callable[[Check], None],
         clock: Callable[[], float]) -> None:
    from elasticd.config import load_config

    try:
        config = load_config(path, env)
    except ConfigError as exc:
        report(fail(f"config {path}: {exc}", "correct the key named above (see deploy/config/ "
                                             "for examples) and run elasticd doctor again"))
        config = None
    if config is not None:
        report(ok(f"config {path} loads (job {config.job.id}, node {config.node.id}, "
                  f"etcd {config.etcd.describe()})"))
        peers = _etcd_and_checkpoint_dir(config, report, clock)
        if peers is not None:
            report(_clock_check(peers, clock()))
    report(_torch_check())
    if config is not None:
        report(_secret_check(config))
        report(_worker_user_check(config))
        for check in _port_checks(config):
            report(check)
    report(_entry_point_check(config.job.python if config is not None else None))


def _secret_check(config: Any) -> Check:
    """``[recovery] secret_file``: usable, as the daemon checks it at its start; absent is a
    warning (the re-formed groups then rest on the firewall, docs/security.md)."""
    from elasticd.config import check_secret_file

    path = config.recovery.secret_file
    if not path:
        return warn("no [recovery] secret_file: in-place groups form unauthenticated",
                    "put the job's secret on every node (head -c 32 /dev/urandom > FILE; "
                    "chmod 600 FILE) and set [recovery] secret_file, or let only the job's "
                    "nodes reach [recovery] store_port")
    try:
        check_secret_file(config.recovery)
    except ConfigError as exc:
        return fail(str(exc), "the fix named above; the daemon does not start without it")
    return ok(f"the job's secret {path} is usable (mode and length; the same file must be on "
              "every node)")


def _worker_user_check(config: Any) -> Check:
    """``[job] worker_user``: usable, as the daemon checks it at its start; unset is a
    warning (the training code can then read the daemon's etcd credentials)."""
    from elasticd.config import check_worker_user

    user = config.job.worker_user
    if not user:
        return warn("no [job] worker_user: the workers run as the daemon's user and can read "
                    "its etcd credentials", "create an unprivileged user for the training code "
                    "and set [job] worker_user (deploy/README.md, docs/security.md)")
    try:
        identity = check_worker_user(config)
    except ConfigError as exc:
        return fail(str(exc), "the fix named above; the daemon does not start without it")
    return ok(f"the workers run as {user} (uid {identity.uid}, gid {identity.gid}) and can use "
              "the checkpoint directory, the job's secret and the entrypoint")


@contextlib.contextmanager
def _captured_warnings(report: Callable[[Check], None]) -> Iterator[None]:
    """Log lines of the code under test (a structlog warning: plaintext password, torch
    outside the tested range) become ``warn`` lines instead of JSON between the checks."""
    import structlog

    with structlog.testing.capture_logs() as logs:
        yield
    for entry in logs:
        if entry.get("log_level") in ("warning", "error", "critical"):
            extra = ", ".join(f"{k}={v}" for k, v in entry.items() if k not in ("event", "log_level"))
            report(warn(f"{entry.get('event')}" + (f" ({extra})" if extra else "")))


# -- etcd and the checkpoint directory -------------------------------------------------


def _doctor_prefix(config: Any) -> str:
    from elasticd.rendezvous.keys import JobKeys

    return f"{JobKeys(config.job.id, config.etcd.key_prefix).prefix}doctor/"


def _etcd_and_checkpoint_dir(config: Any, report: Callable[[Check], None],
                             clock: Callable[[], float]) -> list[dict[str, Any]] | None:
    """Checks 2 and 3. Returns the other nodes' doctor records (None if etcd failed)."""
    client, own = _etcd_check(config, report)
    dir_id = _checkpoint_dir_checks(config, report)
    if client is None:
        if dir_id is not None:
            report(warn("checkpoint dir: not compared with the other nodes (etcd failed above)"))
        return None
    try:
        return _publish_and_compare(config, client, own, dir_id, report, clock)
    finally:
        with contextlib.suppress(Exception):
            client.close()


def _etcd_check(config: Any, report: Callable[[Check], None]) -> tuple[Any, Any]:
    from elasticd.etcd_client import EtcdClient, deadline

    settings = dataclasses.replace(config.etcd.settings(retry_s=ETCD_TIMEOUT_S),
                                   timeout_s=min(config.etcd.timeout_s, ETCD_TIMEOUT_S))
    prefix = _doctor_prefix(config)
    key = f"{prefix}{config.node.id}"
    tls = "TLS" if settings.secure else "plaintext"
    tls += " with a client certificate" if settings.cert else ""
    who = f"user {settings.user!r}" if settings.user else "no user"
    client = None
    step = "connect"
    try:
        with deadline(ETCD_TIMEOUT_S):
            client = EtcdClient(settings)
        step = "read"
        with deadline(ETCD_TIMEOUT_S):
            own = client.get(key)
        step = "write"
        with deadline(ETCD_TIMEOUT_S):
            client.put(key, json.dumps({"node": config.node.id, "probe": True}).encode())
        step = "delete"
        with deadline(ETCD_TIMEOUT_S):
            client.delete(key)
    except EtcdAuthError as exc:
        _close(client)
        report(_auth_failure(config, settings, step, prefix, exc))
        return None, None
    except EtcdUnavailable as exc:
        _close(client)
        report(fail(f"etcd unreachable: no endpoint of {settings.describe()} answered the {step} "
                    f"within {ETCD_TIMEOUT_S:g} s ({tls}): {exc}",
                    "start etcd or correct [etcd] endpoints (ELASTICD_ETCD_ENDPOINTS); check the "
                    "network and firewall from this node; a TLS server needs https:// endpoints "
                    "and ca_cert, a plaintext one neither"))
        return None, None
    except EtcdError as exc:
        _close(client)
        report(fail(f"etcd {step} of {key} at {settings.describe()} failed: {exc}",
                    "read the etcd error above; `etcdctl endpoint health` on this node"))
        return None, None
    report(ok(f"etcd {settings.describe()} ({tls}, {who}): read, write and delete of {key} "
              f"each within {ETCD_TIMEOUT_S:g} s"))
    return client, own


def _auth_failure(config: Any, settings: Any, step: str, prefix: str, exc: Exception) -> Check:
    job_prefix = prefix[:-len("doctor/")]
    text = str(exc).lower()
    if settings.user is None:
        return fail(f"etcd credentials: {settings.describe()} requires authentication and no "
                    f"[etcd] user is set ({step}: {exc})",
                    f"set [etcd] user = \"elasticd-{config.job.id}\" and its password "
                    "(ELASTICD_ETCD_PASSWORD in /etc/elasticd/elasticd.env); "
                    "see deploy/etcd/setup-auth.sh")
    if "permission denied" in text:
        return fail(f"etcd permission: user {settings.user!r} may not {step} keys under "
                    f"{job_prefix} ({exc})",
                    f"grant the user's role readwrite on the prefix {job_prefix}: "
                    f"deploy/etcd/setup-auth.sh ENDPOINTS TLS_DIR {config.job.id} does it, or "
                    f"etcdctl role grant-permission ROLE --prefix=true readwrite {job_prefix}")
    return fail(f"etcd credentials: etcd at {settings.describe()} rejected user {settings.user!r} "
                f"({step}; job prefix {job_prefix}): {exc}",
                "check [etcd] user and the password (ELASTICD_ETCD_PASSWORD in "
                "/etc/elasticd/elasticd.env); re-run deploy/etcd/setup-auth.sh to set it again")


def _close(client: Any) -> None:
    if client is not None:
        with contextlib.suppress(Exception):
            client.close()


def checkpoint_dir_failures(config: Any) -> list[Check]:
    """The checkpoint directory checks that failed, for ``elasticd run`` to refuse to start
    with (a directory the workers cannot create or write otherwise ended as a crash loop,
    "marking this node failed", the cause in agent.log)."""
    found: list[Check] = []
    _checkpoint_dir_checks(config, found.append)
    return [c for c in found if c.failed]


def _open_to_the_workers(config: Any, path: Path) -> None:
    """A checkpoint dir made here is the workers' to write too (``[job] worker_user``:
    rank 0's worker commits there); a user that does not resolve is reported by
    ``_worker_user_check``."""
    from elasticd.contract.identity import IdentityError, resolve, share

    if config.job.worker_user:
        with contextlib.suppress(IdentityError):
            share(path, resolve(config.job.worker_user, config.job.worker_group), sticky=False)


def _bucket_checks(config: Any, report: Callable[[Check], None]) -> str | None:
    """``[checkpoint] dir`` in object storage: reachable, writable (a put, a read back, a
    delete), listable, and its id object; returns the id (None on failure)."""
    from checkpointing import StorageError, StorageNotFoundError, StoragePermissionError
    from checkpointing.object_storage import open_storage

    url = config.checkpoint.dir
    storage = open_storage(url)
    try:
        storage.check_writable()
        storage.listdir()
    except StorageNotFoundError as exc:
        report(fail(f"checkpoint bucket {url}: {exc}", "create the bucket (aws s3 mb, gcloud "
                    "storage buckets create) or fix [checkpoint] dir"))
        return None
    except StoragePermissionError as exc:
        report(fail(f"checkpoint bucket {url}: {exc}", "create the bucket if it does not exist "
                    "(a store may answer a missing bucket with access denied), and give this "
                    "node's credentials put, get, delete and list on the bucket and prefix "
                    "(s3:PutObject, GetObject, DeleteObject, ListBucket)"))
        return None
    except StorageError as exc:
        report(fail(f"checkpoint bucket {url}: {exc}", "check the endpoint (AWS_ENDPOINT_URL for "
                    "a non-AWS store), the network and the credentials in the environment or "
                    "the instance role"))
        return None
    report(ok(f"checkpoint bucket {url}: reachable, writable (put, read back, delete), listable"))
    try:
        dir_id, made = _bucket_id(storage)
    except StorageError as exc:
        report(fail(f"checkpoint bucket {url}: the id object {DIR_ID_FILE} cannot be read or "
                    f"made: {exc}", f"delete {url}/{DIR_ID_FILE} and run elasticd doctor again"))
        return None
    report(ok(f"checkpoint dir id {dir_id} ({'made now' if made else 'read'} from "
              f"{url}/{DIR_ID_FILE})"))
    return dir_id


def _bucket_id(storage: Any) -> tuple[str, bool]:
    """The bucket prefix's id object, made if absent (a race of two first nodes leaves the
    later put's id, which both then read on their next run)."""
    from checkpointing import StorageNotFoundError

    with contextlib.suppress(StorageNotFoundError):
        with storage.open_read(DIR_ID_FILE) as f:
            text = f.read().decode(errors="replace").strip()
        if re.fullmatch(r"[0-9a-f]{16,64}", text):
            return text, False
    dir_id = secrets.token_hex(8)
    with storage.open_write(DIR_ID_FILE) as out:
        out.write(f"{dir_id}\n".encode())
        out.commit()
    return dir_id, True


def _checkpoint_dir_checks(config: Any, report: Callable[[Check], None]) -> str | None:
    """Exists or can be created, writable, free space; returns the dir id (None on failure).
    A bucket URL gets the bucket's checks instead (``_bucket_checks``)."""
    from elasticd.contract.locations import is_url

    if is_url(config.checkpoint.dir):
        return _bucket_checks(config, report)
    path = Path(config.checkpoint.dir)
    user = _user_name()
    if path.exists() and not path.is_dir():
        report(fail(f"checkpoint dir {path} exists but is not a directory",
                    "remove or rename it, or set [checkpoint] dir (ELASTICD_CHECKPOINT_DIR)"))
        return None
    created = False
    if not path.exists():
        try:
            path.mkdir(parents=True, exist_ok=True)
            created = True
            _open_to_the_workers(config, path)
        except OSError as exc:
            report(fail(f"checkpoint dir {path} does not exist and cannot be created as {user}: "
                        f"{exc.strerror or exc}",
                        f"mount the shared storage at {path}, or create it writable by {user}, or "
                        "set [checkpoint] dir (ELASTICD_CHECKPOINT_DIR)"))
            return None
    try:
        _write_probe(path)
    except OSError as exc:
        report(fail(f"checkpoint dir {path} is not writable as {user}: {exc.strerror or exc}",
                    f"make it writable by {user} (chown/chmod), remount the storage read-write, "
                    "or under systemd list it in ReadWritePaths="))
        return None
    usage = shutil.disk_usage(path)
    space = f"{_gib(usage.free)} GiB free of {_gib(usage.total)} GiB"
    what = (f"checkpoint dir {path}{' (created)' if created else ''}: writable as {user} "
            f"(write, fsync, rename, delete), {space}")
    if usage.free < LOW_SPACE_WARN_BYTES:
        report(warn(what, "free space before the next checkpoint: a checkpoint that does not "
                          "fit fails the save"))
    else:
        report(ok(what))
    try:
        dir_id, made = _dir_id(path)
    except (OSError, ValueError) as exc:
        report(fail(f"checkpoint dir {path}: the id file {DIR_ID_FILE} cannot be read or made: {exc}",
                    f"delete {path / DIR_ID_FILE} on one node and run elasticd doctor again"))
        return None
    report(ok(f"checkpoint dir id {dir_id} ({'made now' if made else 'read'} from "
              f"{path / DIR_ID_FILE})"))
    return dir_id


def _write_probe(path: Path) -> None:
    name = f".elasticd-doctor-{os.getpid()}-{secrets.token_hex(4)}"
    tmp, final = path / f"{name}.tmp", path / name
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            os.write(fd, b"elasticd doctor write probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        _fsync_dir(path)
        os.unlink(final)
    finally:
        for leftover in (tmp, final):
            with contextlib.suppress(OSError):
                leftover.unlink()


def _dir_id(path: Path) -> tuple[str, bool]:
    """The directory's id, made atomically if absent: (id, made by this call).

    The id is written to a temp file, then hard-linked to its name: link fails if
    another node made it first (link is atomic on local file systems and NFS alike),
    and the loser reads the winner's id.
    """
    target = path / DIR_ID_FILE
    made = False
    if not target.exists():
        tmp = path / f"{DIR_ID_FILE}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, (secrets.token_hex(16) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, target)
                made = True
                _fsync_dir(path)
            except FileExistsError:
                pass
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    dir_id = target.read_text().strip()
    if len(dir_id) != 32 or any(c not in "0123456789abcdef" for c in dir_id):
        raise ValueError(f"{target} holds {dir_id[:40]!r}, not an id elasticd writes")
    return dir_id, made


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_and_compare(config: Any, client: Any, own: Any, dir_id: str | None,
                         report: Callable[[Check], None],
                         clock: Callable[[], float]) -> list[dict[str, Any]] | None:
    from elasticd.etcd_client import deadline

    prefix = _doctor_prefix(config)
    node = config.node.id
    try:
        with deadline(ETCD_TIMEOUT_S):
            records, _ = client.list_prefix(prefix)
        with deadline(ETCD_TIMEOUT_S):
            lease = _lease(client, own)
            record = {"node": node, "dir_id": dir_id, "dir": config.checkpoint.dir,
                      "host": socket.gethostname(), "time": clock()}
            client.put(f"{prefix}{node}", json.dumps(record).encode(), lease=lease)
    except EtcdError as exc:
        report(fail(f"etcd: publishing this node's doctor record under {prefix} failed: {exc}",
                    "run elasticd doctor again; if it keeps failing, see the etcd check above"))
        return None
    peers, skipped = [], []
    for kv in records:
        name = kv.key[len(prefix):]
        if name == node:
            continue
        try:
            peer = json.loads(kv.value)
            if not isinstance(peer, dict) or not isinstance(peer.get("time"), int | float):
                raise ValueError
        except ValueError:
            skipped.append(name)
            continue
        peers.append({**peer, "node": name})
    if skipped:
        report(warn(f"ignoring malformed doctor record(s) of {', '.join(skipped)} under {prefix}",
                    f"delete them: etcdctl del {prefix}NODE"))
    if dir_id is not None:
        report(_same_dir_check(config, dir_id, peers, clock()))
    return peers


def _lease(client: Any, own: Any) -> int:
    """The lease of this node's previous record, refreshed; a new one if it is gone.
    Reusing it keeps repeated runs (ExecStartPre on every restart) from piling up leases."""
    if own is not None and own.lease_id and client.refresh_lease(own.lease_id) > 0:
        return int(own.lease_id)
    return client.grant_lease(RECORD_TTL_S)


def _same_dir_check(config: Any, dir_id: str, peers: list[dict[str, Any]], now: float) -> Check:
    path = config.checkpoint.dir
    with_id = [p for p in peers if isinstance(p.get("dir_id"), str)]
    different = [p for p in with_id if p["dir_id"] != dir_id]
    if different:
        seen = "; ".join(
            f"node {p['node']} sees a different checkpoint directory (id {p['dir_id']} at "
            f"{p.get('dir')!r} on host {p.get('host')}, published {max(now - p['time'], 0):.0f} s ago)"
            for p in different)
        return fail(f"{seen}; this node ({config.node.id}) has id {dir_id} at {path!r}",
                    f"mount the shared storage at {path} on every node (the same file system: "
                    f"one {DIR_ID_FILE} for all), then run elasticd doctor again on each")
    if not with_id:
        return ok(f"checkpoint dir the same on every node: no other node has published a dir id "
                  f"yet (first node; ours is {dir_id})")
    names = ", ".join(sorted(p["node"] for p in with_id))
    return ok(f"checkpoint dir the same on every node: {names} published the same id {dir_id}")


def _clock_check(peers: list[dict[str, Any]], now: float) -> Check:
    what = ("clock: compared this node's clock with the times the other nodes wrote into their "
            "doctor records (a record's age is unknown, so only a peer clock ahead of ours, "
            f"or ours behind, by more than {CLOCK_AHEAD_WARN_S:g} s shows)")
    if not peers:
        return ok(f"{what}: no other node has published a record yet")
    ahead = [(p["node"], p["time"] - now) for p in peers if p["time"] - now > CLOCK_AHEAD_WARN_S]
    if ahead:
        seen = ", ".join(f"{n} by {d:.1f} s" for n, d in ahead)
        return warn(f"{what}: records in our future: {seen}",
                    "run NTP (chrony/systemd-timesyncd) on every node: the journal, the hang "
                    "bound and checkpoint times compare wall clocks")
    return ok(f"{what}: {len(peers)} record(s), none in our future")


# -- torch, ports, the entry point ---------------------------------------------------------


def _torch_check() -> Check:
    try:
        import torch
    except ImportError as exc:
        from elasticd.rendezvous.torch_compat import SUPPORTED_RANGE

        return fail(f"torch is not importable by {sys.executable}: {exc}",
                    f"pip install 'torch{SUPPORTED_RANGE}' into this interpreter's environment")
    from elasticd.rendezvous.torch_compat import SUPPORTED_RANGE, TorchCompatError, check_torch_apis

    try:
        check_torch_apis()
    except TorchCompatError as exc:
        return fail(str(exc), f"pip install 'torch{SUPPORTED_RANGE}'")
    except Exception as exc:  # a broken torch install raises anything at import time
        return fail(f"torch {torch.__version__}: checking its private APIs raised "
                    f"{type(exc).__name__}: {exc}", f"reinstall torch{SUPPORTED_RANGE}")
    try:
        cuda = (f"CUDA {torch.version.cuda}: {torch.cuda.device_count()} device(s)"
                if torch.cuda.is_available() else "CUDA not available (CPU only)")
    except Exception as exc:
        cuda = f"CUDA query failed ({type(exc).__name__}: {exc})"
    from elasticd.rendezvous.torch_compat import nccl2_backend, reconfigure_api

    reform = ("torch's reconfigure API (gloo" + (", NCCL through nccl2)" if nccl2_backend()
                                                 else ")")
              if reconfigure_api() else "destroy + init (this torch has no reconfigure API)")
    return ok(f"torch {torch.__version__} (tested {SUPPORTED_RANGE}): the private APIs the etcd3 "
              f"rendezvous plugin uses are present; in-place re-forms by {reform}; {cuda}")


def _port_checks(config: Any) -> list[Check]:
    checks = []
    addr = config.node.addr
    try:
        _bind(addr, 0, reuse=False)
        checks.append(ok(f"node addr {addr} is an address of this host (bound a socket to it)"))
    except OSError as exc:
        checks.append(fail(f"node addr {addr} cannot be bound on this host: {exc.strerror or exc}",
                           "set [node] addr (ELASTICD_NODE_ADDR) to this node's own IP on the "
                           "network the other nodes reach it by"))
    port = config.metrics.port
    if port:
        where = f"{config.metrics.addr}:{port}"
        try:
            _bind(config.metrics.addr, port, reuse=True)
            checks.append(ok(f"metrics port {where} is free"))
        except OSError as exc:
            checks.append(fail(f"metrics port {where} cannot be bound: {exc.strerror or exc}",
                               f"stop what listens there (ss -ltnp 'sport = :{port}'; is elasticd "
                               "already running on this node?) or change [metrics] port / addr"))
    return checks


def _bind(addr: str, port: int, reuse: bool) -> None:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        if reuse:   # what the metrics server sets: a port in TIME_WAIT is free for it
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))


_ENTRY_POINT_SCRIPT = (
    "import importlib.metadata as m, sys\n"
    f"eps = [e for e in m.entry_points(group={ENTRY_POINT_GROUP!r}) if e.name == {ENTRY_POINT_NAME!r}]\n"
    "sys.exit(3) if not eps else None\n"
    "eps[0].load()\n"
    "print(eps[0].value)\n"
)


def _entry_point_check(python: str | None) -> Check:
    """The ``etcd3`` handler in the interpreter torchrun runs with (job.python, or ours)."""
    fix = ("pip install elasticd into the environment torchrun runs from (the daemon's venv, "
           "or [job] python's)")
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        python_name = sys.executable
        eps = [e for e in metadata.entry_points(group=ENTRY_POINT_GROUP) if e.name == ENTRY_POINT_NAME]
        if not eps:
            return fail(f"torchrun entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_NAME} is not registered "
                        f"for {python_name}", fix)
        try:
            eps[0].load()
        except Exception as exc:
            return fail(f"torchrun entry point {ENTRY_POINT_NAME} = {eps[0].value} does not load: "
                        f"{type(exc).__name__}: {exc}", fix)
        value = eps[0].value
    else:
        python_name = python
        try:
            out = subprocess.run([python, "-c", _ENTRY_POINT_SCRIPT], capture_output=True, text=True,
                                 timeout=_SUBPROCESS_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return fail(f"[job] python {python} cannot be run: {exc}",
                        "set [job] python to an interpreter that exists, or remove it")
        if out.returncode != 0:
            detail = "not registered" if out.returncode == 3 else out.stderr.strip()[-300:]
            return fail(f"torchrun entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_NAME} for {python}: "
                        f"{detail}", fix)
        value = out.stdout.strip()
    return ok(f"torchrun entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_NAME} = {value} "
              f"(for {python_name})")


def _user_name() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.failed for c in checks) else 0

