"""Names on disk: step directories, data files, the manifest and temporary files.

    <root>/step-000000123/manifest.json              commit marker, written last
    <root>/step-000000123/state-<owner>-<hex>.pt     torch.save of the state
    <root>/step-000000123/.tmp-<owner>-<hex>         a write in progress (or a crashed one)

`<owner>` is `<pid>-<host>` of the writing process, so cleanup can tell a crashed writer's
leftovers (its process is gone) from a live writer's files. Data files get a fresh name on
every save so that re-saving a step never rewrites a file an older manifest points at.
"""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass

MANIFEST_NAME = "manifest.json"
TEMP_PREFIX = ".tmp-"
STEP_PREFIX = "step-"
_STEP_RE = re.compile(r"^step-(\d{9,})$")
_OWNED_RE = re.compile(r"^(?:\.tmp-|state-)(\d+)-([A-Za-z0-9]*)-[0-9a-f]{12}(?:\.[a-z]+)?$")


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32]


@dataclass(frozen=True)
class Owner:
    """The process that wrote a file."""

    pid: int
    host: str

    @classmethod
    def current(cls) -> Owner:
        return cls(os.getpid(), _host_tag())

    def tag(self) -> str:
        return f"{self.pid}-{self.host}"


def step_dir(step: int) -> str:
    """Directory name of `step`; zero-padded so that names sort like steps."""
    return f"{STEP_PREFIX}{step:09d}"


def parse_step_dir(name: str) -> int | None:
    """The step encoded in a directory name, or None if `name` is not a step directory."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def _unique(owner: Owner) -> str:
    return f"{owner.tag()}-{uuid.uuid4().hex[:12]}"


def temp_name(owner: Owner | None = None) -> str:
    """A fresh temporary file name for a write by `owner` (default: this process)."""
    return f"{TEMP_PREFIX}{_unique(owner or Owner.current())}"


def data_name(owner: Owner | None = None) -> str:
    """A fresh data file name for a save by `owner` (default: this process)."""
    return f"state-{_unique(owner or Owner.current())}.pt"


def is_temp(name: str) -> bool:
    return name.startswith(TEMP_PREFIX)


def parse_owner(name: str) -> Owner | None:
    """The writer of a temp or data file, or None if the name carries no owner."""
    match = _OWNED_RE.match(name)
    return Owner(int(match.group(1)), match.group(2)) if match else None


# Names a manifest may list: what data_name() writes and more, but nothing that could leave
# the step directory or break an OS call (separators, NUL, "..", a leading dot, control
# characters) and no longer than a file name may be.
_SAFE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


def is_safe_file_name(name: object) -> bool:
    """True for a plain file name that stays inside its directory and is not a temp name."""
    return isinstance(name, str) and _SAFE_NAME_RE.fullmatch(name) is not None
