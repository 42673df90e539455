"""trainer/examples/mlp.py, except that one rank hangs (no crash, no exit) once.

After ``HANG_AFTER`` batches, the worker whose RANK is ``HANG_RANK`` sleeps forever,
unless ``HANG_MARKER`` exists; it creates the marker first, so the restarted job
does not hang again. Its peers block in DDP's all-reduce: a hang, not a failure.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trainer.examples import common
from trainer.examples.mlp import make_data, make_model, make_optimizer, per_sample_loss
from trainer.exitcodes import exit_worker


def main() -> int:
    p = common.parser("mlp that hangs once", batch_size=16, lr=0.05)
    args = common.parse(p)
    dtype = common.DTYPES[args.dtype]
    x, y = make_data(4096, 1234, dtype)
    model = make_model(dtype)
    marker = Path(os.environ["HANG_MARKER"])
    hang_here = os.environ.get("RANK") == os.environ.get("HANG_RANK", "1")
    calls = {"n": 0}

    def batch_fn(idx):
        calls["n"] += 1
        if hang_here and calls["n"] > int(os.environ.get("HANG_AFTER", "30")) and not marker.exists():
            marker.touch()
            while True:
                time.sleep(3600)
        return x[idx], y[idx]

    return common.train(args, model, make_optimizer(model, args.lr, 0.9), len(x),
                        batch_fn=batch_fn, loss_fn=per_sample_loss)


if __name__ == "__main__":
    exit_worker(main())
