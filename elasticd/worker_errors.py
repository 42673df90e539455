"""The workers' last error, as the agent log shows it, for the sentence that fails a node.

A worker that cannot run (the NCCL backend on a machine without it, a checkpoint directory
it cannot create) dies with a Python traceback in ``<run_dir>/agent.log``, followed by
torchrun's own ``ChildFailedError`` summary. The daemon used to end such a node with "the
workers crashed 5 times without progress", the cause only in that file (often in a temp
directory). ``LastError`` follows the file as it grows (a cycle reads only the new bytes)
and keeps the last exception line of a worker's traceback; torchrun's wrappers are not a
cause.
"""

from __future__ import annotations

import re
from pathlib import Path

# Exceptions the agent raises about its workers or itself, never the workers' cause.
AGENT_EXCEPTIONS = frozenset({"ChildFailedError", "SignalException", "KeyboardInterrupt", "SystemExit"})
# The first line after a traceback's indented frames: "pkg.module.Type: message" (or "Type").
_EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<message>.*))?$")
_READ_MAX = 1 << 20     # at most this much of the file's new bytes per read (the newest)
MAX_CHARS = 300         # what a log line, a journal entry and a node record carry


def exception_lines(text: str) -> list[str]:
    """The exception line ending each traceback in ``text`` (a worker's, not the agent's)."""
    found = []
    in_traceback = False
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            in_traceback = False
            m = _EXCEPTION_LINE.match(line.strip())
            if m and m["type"].rsplit(".", 1)[-1] not in AGENT_EXCEPTIONS:
                found.append(_short(line.strip()))
    return found


def _short(line: str) -> str:
    return line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."


class LastError:
    """The newest worker exception line in a log file, read incrementally."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._inode: int | None = None
        self._open = ""             # a traceback whose exception line is not written yet
        self.last: str | None = None

    def forget(self) -> None:
        """Drop the error seen so far (an agent starts: its workers' errors are news)."""
        self.last = None

    def update(self) -> str | None:
        """Read what was appended since the last call; the newest error seen so far."""
        try:
            st = self.path.stat()
            size = st.st_size
            if size < self._offset or st.st_ino != self._inode:
                # Rotated (agent.rotate_log, before an agent starts): a new file.
                self._offset, self._open, self._inode = 0, "", st.st_ino
            if size == self._offset:
                return self.last
            start = max(self._offset, size - _READ_MAX)
            with open(self.path, "rb") as f:
                f.seek(start)
                chunk = f.read(size - start).decode("utf-8", "replace")
        except OSError:
            return self.last
        text = (self._open if start == self._offset else "") + chunk
        self._offset = size
        end = text.rfind("\n") + 1          # a line still being written waits too
        complete, open_traceback = _split_open_traceback(text[:end])
        self._open = open_traceback + text[end:]
        errors = exception_lines(complete)
        if errors:
            self.last = errors[-1]
        return self.last


def _split_open_traceback(text: str) -> tuple[str, str]:
    """``text`` without a last traceback still being written, and that traceback."""
    cut = text.rfind("Traceback (most recent call last):")
    if cut < 0:
        return text, ""
    after = text[cut:].splitlines()[1:]
    closed = any(line and not line[0].isspace() for line in after)
    return (text, "") if closed or len(text) - cut > _READ_MAX else (text[:cut], text[cut:])


__all__ = ["AGENT_EXCEPTIONS", "MAX_CHARS", "LastError", "exception_lines"]
