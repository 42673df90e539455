"""One member of a group moved between generations by a ``trainer.reform`` mechanism.

    python reform_member.py NODE DIR MECHANISM [HOST:PORT RANK SIZE]

With a world (``HOST:PORT RANK SIZE``: a founding member; rank 0 hosts that store, as
torchrun's rank 0 does) the member creates the group of generation 0.0 there
(``reform.create_group``); without one it is a newcomer and enters the first generation
whose record names it (``reform.join_as_newcomer``). Then it follows ``DIR/gen<i>.json``
(i = 1, 2, ...: generation records the test writes, standing in for the daemons): in each
generation that names it, it re-forms and all-reduces rank + 1; a record that leaves it
out, or ``DIR/done``, ends it. ``DIR/NODE.json`` gets every generation's result.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elasticd.contract.generation import GenerationId, GenerationRecord
from trainer import reform

TIMEOUT = timedelta(seconds=20)
CPU = torch.device("cpu")


def main() -> None:
    node, folder, mechanism = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    results: list[dict] = []

    def note(gen: str, took: float) -> None:
        x = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
        dist.all_reduce(x)
        results.append({"generation": gen, "rank": dist.get_rank(),
                        "world_size": dist.get_world_size(), "sum": x.item(), "took_s": took})
        tmp = folder / f"{node}.tmp"
        tmp.write_text(json.dumps({"mechanism": mech.name, "results": results}))
        os.replace(tmp, folder / f"{node}.json")

    i, mech = 1, None
    if len(sys.argv) > 4:  # a founder: torchrun's world, its store on rank 0
        host, _, port = sys.argv[4].rpartition(":")
        rank, size = int(sys.argv[5]), int(sys.argv[6])
        store = dist.TCPStore(host, int(port), is_master=rank == 0, timeout=TIMEOUT,
                              wait_for_workers=False)
        started = time.monotonic()
        reform.create_group("gloo", store, rank, size, GenerationId(0, 0, "t"), TIMEOUT, None,
                            mechanism=mechanism)
        mech = reform.mechanism_for("gloo", [])
        note("0.0", time.monotonic() - started)
    while not (folder / "done").exists():
        path = folder / f"gen{i}.json"
        if not path.exists():
            time.sleep(0.01)
            continue
        record = GenerationRecord.from_json(path.read_text())
        i += 1
        rank = record.rank_of(node, 0)
        if rank is None:
            if mech is None:
                continue  # a newcomer waits for the record that names it
            break
        started = time.monotonic()
        if mech is None:
            reform.join_as_newcomer(record, rank, "gloo", CPU, TIMEOUT, 10.0, mechanism)
            mech = reform.mechanism_for("gloo", [])
        else:
            mech.leave(10.0)
            mech.join(record, rank, "gloo", CPU, TIMEOUT, 10.0, newer=lambda: None)
        note(str(record.id), time.monotonic() - started)
    os._exit(0)  # no teardown: an abandoned group's destructors may wait on dead peers


if __name__ == "__main__":
    main()
