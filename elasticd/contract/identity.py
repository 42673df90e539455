"""Who the workers run as: the training code under a Unix user of its own.

The daemon and its torchrun agent hold the job's etcd credentials (the client key, the
password the agent gets on its stdin). The workers are the agent's children; run as the
agent's user they could read the key files and the agents' memory, and so write the
job's etcd prefix. With ``[job] worker_user`` every worker becomes that user before the
training script runs, with no capability left:

* a cold worker: torchrun runs ``python -m elasticd.contract.identity PYTHON -u SCRIPT
  ARGS`` (``launcher_command``); it opens the worker's error file to it, then execs the
  interpreter through util-linux ``setpriv`` (``setpriv_command``);
* a warm worker (``elasticd.warmstart``): the server's forked child switches (``enter``)
  before it runs the script; the client's cold fallback execs as the launcher does.

Both read the identity from ``ELASTICD_WORKER_USER`` (``uid:gid:groups``), which the
daemon puts in the workers' environment: it tells a process what to become, it grants
nothing (switching needs the privilege the daemon's processes have and the workers lose).

The daemon must be able to switch users (root, or ``CAP_SETUID`` and ``CAP_SETGID``) and
to signal and watch processes of another user (``CAP_KILL``): ``switch_refusal`` says
what is missing. The directories it shares with the workers (the run directory, their
``TMPDIR``, torchrun's error-file directories) are made the workers' group's (``share``);
``worker_can`` asks the kernel, as the worker user, whether a path is usable (the
checkpoint directory at start).

Torch-free and import-light: the launcher runs before every cold worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import grp
import os
import pwd
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

WORKER_USER_VAR = "ELASTICD_WORKER_USER"
SETPRIV = "/usr/bin/setpriv"
# Linux capability numbers (linux/capability.h) the daemon needs to run workers as
# another user: signal them (torchrun, the warm server and the daemon kill worker trees),
# set their groups and ids.
CAP_KILL, CAP_SETGID, CAP_SETUID = 5, 6, 7
_NEEDED = {"CAP_KILL": CAP_KILL, "CAP_SETGID": CAP_SETGID, "CAP_SETUID": CAP_SETUID}
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 1, 4, 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# torchrun's error file: LOG_DIR/<run id>_<random>/attempt_<n>/<local rank>/error.json.
# The three directories above the file are the agent's (mkdtemp: mode 0700).
_ERROR_FILE_DIRS = 3


class IdentityError(ValueError):
    """The worker user cannot be used; the message names what is wrong and the fix."""


@dataclass(frozen=True)
class WorkerIdentity:
    """A Unix user (and its groups) a worker becomes."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def encode(self) -> str:
        return f"{self.uid}:{self.gid}:{','.join(map(str, self.groups))}"

    @classmethod
    def decode(cls, text: str) -> WorkerIdentity:
        """The inverse of ``encode``; ``IdentityError`` for anything else."""
        try:
            uid, gid, groups = text.split(":")
            return cls(int(uid), int(gid), tuple(int(g) for g in groups.split(",") if g))
        except ValueError:
            raise IdentityError(f"{WORKER_USER_VAR}={text!r} is not uid:gid:groups "
                                "(the daemon sets it; unset it by hand)") from None


def resolve(user: str, group: str = "") -> WorkerIdentity:
    """The identity of ``user`` (a name or a uid) with ``group`` (a name or gid; default
    the user's primary group) and the user's supplementary groups."""
    try:
        entry = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        raise IdentityError(f"no Unix user {user!r}: create it (useradd --system "
                            f"--no-create-home {user}) or name an existing one") from None
    if entry.pw_uid == 0:
        raise IdentityError(f"{user!r} is root: the workers would keep every privilege; "
                            "name an unprivileged user")
    gid = entry.pw_gid
    if group:
        try:
            gid = grp.getgrgid(int(group)).gr_gid if group.isdigit() else grp.getgrnam(group).gr_gid
        except (KeyError, OverflowError):
            raise IdentityError(f"no Unix group {group!r}: create it (groupadd --system "
                                f"{group}) or name an existing one") from None
    groups = tuple(sorted({g.gr_gid for g in grp.getgrall() if entry.pw_name in g.gr_mem} - {gid}))
    return WorkerIdentity(entry.pw_uid, gid, groups)


def capabilities(pid: int | str = "self") -> int:
    """The effective capability set of ``pid`` (a bit mask; ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def switch_refusal(identity: WorkerIdentity) -> str | None:
    """Why this process cannot run workers as ``identity`` (None: it can)."""
    if os.geteuid() == identity.uid:
        return None
    effective = capabilities()
    missing = [name for name, bit in _NEEDED.items() if not effective >> bit & 1]
    if not missing:
        return None
    return (f"running workers as uid {identity.uid} needs root or {', '.join(missing)}; "
            "run the daemon as root, or give it those capabilities (the shipped unit's "
            "AmbientCapabilities=), or leave [job] worker_user unset")


def launcher_command(python: str, entry: list[str]) -> list[str]:
    """torchrun's cold worker command (after ``--no-python``): the launcher, then the
    interpreter with ``entry`` (SCRIPT ARGS, or -m MODULE ARGS)."""
    return [python, "-m", "elasticd.contract.identity", python, "-u", *entry]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _drop_capabilities() -> None:
    """Empty the effective, permitted, inheritable and ambient sets (a non-root process
    keeps its capabilities across setuid; root loses them there, and this is a no-op)."""
    libc = _libc()
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient caps")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()   # two {effective, permitted, inheritable}: all empty
    _check(libc.capset(header, data), "capset")


def open_error_file(env: dict[str, str], identity: WorkerIdentity) -> None:
    """Let the worker write torchrun's error file (its traceback, which the agent and the
    daemon report): its directories are the agent's, mode 0700. Best effort: without it
    only the traceback file is lost."""
    path = env.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    for depth, folder in enumerate(list(Path(path).parents)[:_ERROR_FILE_DIRS]):
        with contextlib.suppress(OSError):
            os.chown(folder, -1, identity.gid)
            extra = stat.S_IRWXG if depth == 0 else stat.S_IXGRP
            os.chmod(folder, stat.S_IMODE(os.stat(folder).st_mode) | extra)


def enter(identity: WorkerIdentity, env: dict[str, str] | None = None) -> None:
    """Become ``identity`` for good, with no capability; ``OSError`` if anything is left.

    ``env``: the environment to fix up (``HOME`` becomes the user's; default
    ``os.environ``). The parent-death signal, which the kernel clears on a change of
    ids, is set again if it was set; the process is made dumpable again (its /proc
    files then belong to the worker user, as after an exec).
    """
    env = os.environ if env is None else env
    libc = _libc()
    pdeath = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(pdeath), 0, 0, 0)   # PR_GET_PDEATHSIG
    if os.geteuid() != identity.uid:
        os.setgroups(list(identity.groups))
        os.setresgid(identity.gid, identity.gid, identity.gid)
        os.setresuid(identity.uid, identity.uid, identity.uid)
    _drop_capabilities()
    if os.getresuid() != (identity.uid,) * 3 or os.getresgid() != (identity.gid,) * 3:
        raise OSError(f"still {os.getresuid()}/{os.getresgid()} after becoming {identity}")
    if capabilities():
        raise OSError(f"capabilities {capabilities():#x} left after becoming uid {identity.uid}")
    libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
    if pdeath.value:
        libc.prctl(_PR_SET_PDEATHSIG, pdeath.value, 0, 0, 0)
    _home(identity, env)


def _home(identity: WorkerIdentity, env: dict[str, str]) -> None:
    """``HOME`` becomes the user's (caches under it must be the worker's to write)."""
    with contextlib.suppress(KeyError):
        env["HOME"] = pwd.getpwuid(identity.uid).pw_dir


def requested(env: dict[str, str] | None = None) -> WorkerIdentity | None:
    """The identity ``env`` (default ``os.environ``) asks a worker to take, or None."""
    text = (os.environ if env is None else env).get(WORKER_USER_VAR)
    return WorkerIdentity.decode(text) if text else None


def become_worker(identity: WorkerIdentity, env: dict[str, str] | None = None) -> None:
    """What a worker process does first when it has a user of its own: open its error
    file to it, then take ``identity`` (``enter``)."""
    env = os.environ if env is None else env
    open_error_file(env, identity)
    enter(identity, env)


def share(path: Path, identity: WorkerIdentity, *, sticky: bool = True) -> None:
    """Make directory ``path`` the workers' too: their group, group-writable. ``sticky``:
    nobody removes or renames another user's files in it, so a worker cannot swap a file
    of the daemon's (the warm socket).

    No set-group-ID bit (systemd's ``RestrictSUIDSGID=`` refuses it): a file keeps its
    creator's group, so the daemon's files are the workers' group's where that group is
    the daemon's own (the shipped unit's ``Group=``), and a worker's file is that group's
    anyway."""
    os.chown(path, -1, identity.gid)
    os.chmod(path, stat.S_IRWXU | stat.S_IRWXG | (stat.S_ISVTX if sticky else 0))


def setpriv_command(identity: WorkerIdentity, command: list[str]) -> list[str]:
    """``command`` run as ``identity`` by util-linux ``setpriv``: ids and groups set, the
    inheritable and ambient capability sets emptied, so the program it execs (no file
    capabilities) holds none."""
    groups = (f"--groups={','.join(map(str, identity.groups))}" if identity.groups
              else "--clear-groups")
    return [SETPRIV, f"--reuid={identity.uid}", f"--regid={identity.gid}", groups,
            "--inh-caps=-all", "--ambient-caps=-all", "--", *command]


def worker_can(identity: WorkerIdentity, path: str, modes: str = "rwx") -> bool:
    """Whether ``identity`` may ``r``ead, ``w``rite and e``x``ecute/enter ``path`` (the
    letters in ``modes``), asked of the kernel as that user (ACLs and NFS included)."""
    if os.geteuid() == identity.uid:
        flags = {"r": os.R_OK, "w": os.W_OK, "x": os.X_OK}
        return os.access(path, sum(flags[m] for m in modes))
    test = ["test", "-e", path]
    for letter in modes:
        test += ["-a", f"-{letter}", path]
    return subprocess.run(setpriv_command(identity, test), check=False).returncode == 0


def exec_worker(command: list[str]) -> NoReturn:
    """Replace this process with ``command``, run as the identity ``ELASTICD_WORKER_USER``
    names (its error file opened to it, its ``HOME``, through ``setpriv``), or as this
    process's user when it names none. ``IdentityError`` for a malformed variable."""
    identity = requested()
    if identity is None:
        os.execvp(command[0], command)
    open_error_file(os.environ, identity)
    _home(identity, os.environ)
    os.execv(SETPRIV, setpriv_command(identity, command))


def main(argv: list[str] | None = None) -> None:
    """The cold launcher: ``python -m elasticd.contract.identity PROGRAM ARGS...``."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        sys.exit("usage: python -m elasticd.contract.identity PROGRAM [ARGS...]")
    try:
        exec_worker(args)
    except IdentityError as exc:
        sys.exit(f"elasticd: cannot run the worker as its user: {exc}")


if __name__ == "__main__":
    main()
