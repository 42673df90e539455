"""trainer/examples/mlp.py that first tries, as whatever user it runs as, to reach what its
daemon holds: every path in ``PEEK_PATHS`` (key files, the env file with the etcd
password), its daemon's ``/proc/PID/environ`` and ``mem``, and its parent's ``environ``
(the torchrun agent, or the warm-start server that forked it). It writes what happened,
with its ids and capabilities, to ``PEEK_DIR/<pid>.json``, then trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

from elasticd.contract.identity import capabilities
from trainer.examples.mlp import main


def attempt(path: str) -> str:
    """``read`` when one byte of ``path`` could be read, else the error's name."""
    try:
        with open(path, "rb") as f:
            f.read(1)
        return "read"
    except OSError as exc:
        return type(exc).__name__


if __name__ == "__main__":
    daemon = os.environ["ELASTICD_DAEMON_PID"]
    targets = [p for p in os.environ.get("PEEK_PATHS", "").split(os.pathsep) if p]
    targets += [f"/proc/{daemon}/environ", f"/proc/{daemon}/mem", f"/proc/{os.getppid()}/environ"]
    report = {"uid": os.getresuid(), "gid": os.getresgid(), "groups": os.getgroups(),
              "caps": capabilities(), "home": os.environ.get("HOME"),
              "tried": {path: attempt(path) for path in targets}}
    Path(os.environ["PEEK_DIR"], f"{os.getpid()}.json").write_text(json.dumps(report))
    raise SystemExit(main())
