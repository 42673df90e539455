"""What an agent says when its run's rendezvous is closed: what happened, and the fix.

An agent closes the rendezvous once its workers succeeded (``shutdown`` in handler.py and
keyed.py), and from then on every agent started with that run id fails with
``RendezvousClosedError``: rerunning a command that completed, with the same
``--rdzv-id``, is the usual way to get there. torch raises the error bare (rounds=torch)
and torchrun prints it as the last line of a ~40-line traceback, so that line is the one
place to tell the user that the run completed and how to start the next one.

The closed mark (keyed rounds' ``rdzv/closed``, torch's ``closed`` in ``rdzv/state``) is on
the closing agent's run lease: it expires ``ttl`` seconds after that agent exited
(measured: with ``ttl=3`` the same command ran again 5 s later). The keys to delete are the
whole ``<key_prefix>/<run-id>/``: with ``recovery=in-place`` the companion's agreed
generation lives beside ``rdzv/`` (``JobKeys.generation``).
"""

from __future__ import annotations

import os
import shlex

from elasticd.etcd_client import EtcdSettings
from elasticd.rendezvous.keys import JobKeys

# Set by the daemon in its agent's environment: the run id is then its [job] id.
DAEMON_PID_ENV = "ELASTICD_DAEMON_PID"


def closed_message(run_id: str, keys: JobKeys, etcd: EtcdSettings, ttl_s: int) -> str:
    """The ``RendezvousClosedError`` text: the run is over, why it stays so, and the two fixes
    (a new run id, or the exact ``etcdctl`` command that deletes this one's keys)."""
    under_daemon = bool(os.environ.get(DAEMON_PID_ENV))
    new_id = "a new [job] id (or ELASTICD_JOB_ID)" if under_daemon else "a new --rdzv-id"
    ttl = f"[rendezvous] ttl={ttl_s}" if under_daemon else f"--rdzv-conf ttl={ttl_s}"
    stopped = "every daemon" if under_daemon else "every agent"
    return (f"the rendezvous of run {run_id!r} is closed: a run with this id completed (an "
            f"agent closes the rendezvous once its workers succeed), and it stays closed until "
            f"the closing agent's lease expires ({ttl} s after that run's agents exited). "
            f"Start the next run with {new_id}, or reuse this one after deleting its keys with "
            f"{stopped} stopped: {delete_command(keys, etcd)}")


def delete_command(keys: JobKeys, etcd: EtcdSettings) -> str:
    """``etcdctl ... del --prefix`` of the run's keys, with the endpoints, TLS files and user
    this agent was given (etcdctl asks for the password: it is never printed)."""
    scheme = "https://" if etcd.secure else ""
    endpoints = ",".join(e if "://" in e else scheme + e for e in etcd.endpoints)
    flags = [f"--endpoints={endpoints}"]
    for flag, path in (("cacert", etcd.ca_cert), ("cert", etcd.cert), ("key", etcd.key)):
        if path:
            flags.append(f"--{flag}={shlex.quote(path)}")
    if etcd.user:
        flags.append(f"--user={shlex.quote(etcd.user)}")
    return f"etcdctl {' '.join(flags)} del --prefix {keys.prefix}"
