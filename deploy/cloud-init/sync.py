#!/usr/bin/env python3
"""Copy deploy/ files into the cloud-init user-data, which must be self-contained.

    python3 deploy/cloud-init/sync.py           # rewrite the embedded copies
    python3 deploy/cloud-init/sync.py --check   # exit 1 if any copy is stale (tests, CI)

Each embedded file sits between ``# BEGIN <path>`` and ``# END <path>`` comments (path
relative to the repository root) as a literal block scalar ``content: |``.
Standard library only: it runs wherever the repository does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BLOCK = re.compile(r"^(?P<indent> *)# BEGIN (?P<path>\S+)\n.*?^(?P=indent)# END (?P=path)\n",
                   re.MULTILINE | re.DOTALL)


def embed(match: re.Match[str]) -> str:
    indent, path = match["indent"], match["path"]
    body = (REPO / path).read_text()
    lines = [f"{indent}  {line}" if line else "" for line in body.splitlines()]
    return "\n".join([f"{indent}# BEGIN {path}", f"{indent}content: |", *lines,
                      f"{indent}# END {path}"]) + "\n"


def render(text: str) -> str:
    """``text`` with every embedded block refreshed from its source file."""
    return BLOCK.sub(embed, text)


def user_data_files() -> list[Path]:
    return sorted(HERE.glob("*.yaml"))


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print("usage: sync.py [--check]", file=sys.stderr)
        return 2
    stale = []
    for path in user_data_files():
        text = path.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(path)
            if not argv:
                path.write_text(fresh)
    if stale and argv:
        names = ", ".join(p.name for p in stale)
        print(f"stale copies in {names}: run deploy/cloud-init/sync.py", file=sys.stderr)
        return 1
    for path in stale:
        print(f"updated {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
