"""One rank of a real gloo group that runs ``trainer.fitness`` on its own checkpoint
directory and prints the outcome as one JSON line (tests/trainer/test_fitness.py)."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from checkpointing import CheckpointManager
from trainer import dist as tdist
from trainer.exitcodes import exit_worker
from trainer.fitness import NONE, Fitness, NodeUnfit, PeerUnfit


def main() -> None:
    rank, world, port, node, directory = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                          int(sys.argv[4]), sys.argv[5])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    manager = CheckpointManager(directory, read_only=True)

    def newest() -> int:
        step = manager.latest_step()
        return NONE if step is None else step

    fitness = Fitness(node, torch.device("cpu"), directory, newest, tdist.collective)
    fail_load = len(sys.argv) > 6 and sys.argv[6] == "fail-load"
    try:
        out = {"newest": fitness.agree_newest()}
        if out["newest"] != NONE:  # every rank judges the loads (rank 0's included)
            fitness.judge_loads(out["newest"], OSError("Input/output error") if fail_load else None)
    except (NodeUnfit, PeerUnfit) as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    print(json.dumps(out), flush=True)
    exit_worker(0)


if __name__ == "__main__":
    main()
