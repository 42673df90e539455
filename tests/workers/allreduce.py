"""Worker for rendezvous tests: all-reduce once per step, report each round.

Each step sums (rank + 1) across the world and checks the result equals
world_size * (world_size + 1) / 2, then appends one JSON line to
``$REPORT_DIR/<node>-<local_rank>.jsonl``. Runs until the stop file exists.

Whether to stop travels in the same all-reduce, so every rank stops after the same step: a
rank that saw the file one step before its peer would otherwise leave it blocked in the next
all-reduce, to fail and be restarted into a rendezvous nobody else joins.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    report = os.path.join(os.environ["REPORT_DIR"],
                          f"{os.environ.get('NODE_NAME', 'n')}-{os.environ['LOCAL_RANK']}.jsonl")
    stop_file = os.environ.get("STOP_FILE", "")
    step = 0
    max_steps = int(os.environ.get("MAX_STEPS", "1000000"))
    while step < max_steps:
        asked_to_stop = float(bool(stop_file) and os.path.exists(stop_file))
        value = torch.tensor([float(rank + 1), asked_to_stop])
        dist.all_reduce(value)
        ok = value[0].item() == world * (world + 1) / 2
        with open(report, "a") as fh:
            fh.write(json.dumps({"rank": rank, "world": world, "step": step, "ok": ok, "pid": os.getpid(),
                                 "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
                                 "t": time.time()}) + "\n")
        step += 1
        if value[1].item() > 0:
            break
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.2")))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
