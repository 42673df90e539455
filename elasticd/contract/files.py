"""How the two sides write the files they exchange (the workers' progress record, the
generation file the daemon or the companion hands to the workers): replaced whole, so a
reader polling the file sees the old or the new content, never half of it. Torch-free."""

from __future__ import annotations

import os


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` so that a reader sees the old or the new file, whole;
    raises ``OSError`` when it cannot."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
