"""How the two sides write the files they exchange (the workers' progress record, the
generation file the daemon or the companion hands to the workers): replaced whole, so a
reader polling the file sees the old or the new content, never half of it. Torch-free.

The temporary file is made with a random name and ``O_EXCL`` (``mkstemp``): the run
directory is shared with the workers, who may run as another user (``[job]
worker_user``); a predictable name would let one plant a symlink there and have the
daemon write through it."""

from __future__ import annotations

import contextlib
import os
import tempfile


def write_atomic(path: str | os.PathLike[str], content: str | bytes) -> None:
    """Replace ``path`` with ``content`` so that a reader sees the old or the new file,
    whole (mode 0666 less the umask, as ``open`` makes it); raises ``OSError`` when it
    cannot."""
    folder, name = os.path.split(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=folder or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it, for every
    thread, for a moment)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022
