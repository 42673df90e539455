"""The job's secret: what every member of an in-place group proves it knows before any
state is taken from it.

The group forms through a daemon's TCP store, which torch does not authenticate: anyone
who reaches its port can read and set its keys (``list_keys`` shows every generation's
prefix), and so could slip a process of its own into the group gloo or NCCL forms there.
The daemons agree the membership in etcd (``inplace.vetting``), but what connected is
only known once the group exists. So right after forming, each member all-gathers a
proof: HMAC-SHA256 over the generation, its store, and the rank and node the record
gives that member, keyed with the job's secret (``trainer.inplace.vouch``). A member
whose proof is wrong ends the re-form (the restart path), before any state moves.

The secret is a file the operator puts on every node of the job (the same bytes, like
the etcd certificates; ``[recovery] secret_file``), closed to other users;
the daemon hands its path to its workers (``ELASTICD_SECRET_FILE``). It is never written
to etcd, to the store, to a record or to a log. Without one the groups form
unauthenticated, and the store's port must be reachable by the job's nodes alone
(docs/security.md).

This module is torch-free: the daemon's config check and the workers both import it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

MIN_BYTES = 16
MAKE_ONE = "make one with: head -c 32 /dev/urandom > FILE; chmod 600 FILE (the same file on every node)"


class SecretError(ValueError):
    """The job's secret file cannot be used; the message names the file and the fix."""


def read_secret(path: str) -> bytes:
    """The secret in ``path``, checked: a regular file, at least ``MIN_BYTES`` bytes, no
    access for other users (owner and group: the deploy's files are root's, group the
    daemon's, mode 640) (``SecretError`` names what is wrong and the fix)."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise SecretError(f"the job's secret file {path} is not a regular file; {MAKE_ONE}")
        if info.st_mode & stat.S_IRWXO:
            raise SecretError(f"the job's secret file {path} is open to every user (mode "
                              f"{stat.S_IMODE(info.st_mode):o}); chmod 600 {path} (or 640, "
                              "its group the daemon's alone)")
        with open(path, "rb") as f:
            secret = f.read(4096)
    except OSError as exc:
        raise SecretError(f"the job's secret file {path} cannot be read ({exc.strerror}); "
                          f"{MAKE_ONE}") from None
    if len(secret) < MIN_BYTES:
        raise SecretError(f"the job's secret file {path} holds {len(secret)} bytes, fewer than "
                          f"{MIN_BYTES}; {MAKE_ONE}")
    return secret


def proof(secret: bytes, generation: str, store: str | None, rank: int, node: str) -> bytes:
    """What the member at ``rank`` (of ``node``) of ``generation`` formed through ``store``
    shows the others: 32 bytes only a holder of ``secret`` can make."""
    message = f"elasticd-member|{generation}|{store}|{rank}|{node}".encode()
    return hmac.new(secret, message, hashlib.sha256).digest()
