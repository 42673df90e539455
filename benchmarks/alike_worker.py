"""The worker of ``benchmarks/alike.py``: trainer/examples/mlp.py, plus what its weights and
arithmetic were at the end, as one JSON file per process.

It trains exactly as the example (``mlp.main`` with the same command line); once training
returns, the process writes ``$ALIKE_DIR/<node>-<pid>.json``: its rank, whether it was
forked warm by the daemon's warm-start server or started cold, torch's intra-op thread
count, and a sha256 of its final parameters' bytes. DDP replicas must end bit-identical,
and identical runs must end bit-identical: the harness compares these.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import psutil
import torch
from torch import nn

from trainer.examples import mlp
from trainer.exitcodes import exit_worker


def weights_digest(model: nn.Module) -> str:
    """sha256 over every parameter's bytes, in ``state_dict`` order."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def forked_warm() -> bool:
    """Whether this process was forked by a warm-start server (``elasticd.warmstart --serve``)
    rather than started cold by the client's exec."""
    try:
        return "--serve" in psutil.Process(os.getppid()).cmdline()
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    kept: list[nn.Module] = []
    code = mlp.main(argv, on_model=kept.append)
    record = {
        "node": os.environ.get("ELASTICD_NODE_ID", "?"), "rank": int(os.environ.get("RANK", -1)),
        "pid": os.getpid(), "code": code,
        "warm": forked_warm(),
        "threads": torch.get_num_threads(),
        "digest": weights_digest(kept[0]),
    }
    out = Path(os.environ["ALIKE_DIR"]) / f"{record['node']}-{record['pid']}.json"
    out.write_text(json.dumps(record) + "\n")
    return code


if __name__ == "__main__":
    exit_worker(main())
