"""One rank of a real gloo group that runs ``trainer.nonfinite.attribute`` with a given
first bad step and prints the outcome as one JSON line (tests/trainer/test_nonfinite.py).

argv: rank world port node first_bad suspects_path|- weights(nan|ok); the rank's step
spans are those of a global batch of 12 from position 0 (step s consumed samples
12(s-1)..12s-1). "returned": attribute charged nobody."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer import dist as tdist
from trainer.errors import TrainingDiverged
from trainer.exitcodes import exit_worker
from trainer.fitness import NodeUnfit, PeerUnfit
from trainer.nonfinite import FirstBad, Span, Suspects, attribute


def main() -> None:
    rank, world, port, node, first_bad = (int(a) for a in sys.argv[1:6])
    suspects = Suspects(None if sys.argv[6] == "-" else sys.argv[6])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model = torch.nn.Linear(2, 1)
    if sys.argv[7] == "nan":
        with torch.no_grad():
            model.bias.fill_(float("nan"))
    seen = FirstBad()
    for step in range(1, 21):
        bad = first_bad != -1 and step >= first_bad
        seen.note(step, torch.tensor(float("nan") if bad else 1.0), Span(0, 12 * (step - 1), 12 * step))
    try:
        attribute(node, seen, suspects, model, torch.device("cpu"), tdist.collective,
                  is_local_rank0=rank == node)
        out = {"outcome": "returned"}
    except (NodeUnfit, PeerUnfit, TrainingDiverged) as exc:
        out = {"outcome": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)
    exit_worker(0)


if __name__ == "__main__":
    main()
