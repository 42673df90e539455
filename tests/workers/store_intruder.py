"""A host on the node network that reaches a daemon's recovery store (issue 27, finding 4).

Run as ``python store_intruder.py HOST:PORT PREFIX RANK WORLD OUT``: it connects to the
store (torch's TCPStore authenticates nobody), counts itself as arrived under the
generation's predictable prefix, and joins the group gloo forms there as ``RANK``, ahead
of the real member. If gloo lets it in, it takes part in the members' first collective
with a proof it cannot make and then waits, as a process that wanted to hand its own
state over would. What happened goes to ``OUT`` (JSON), step by step.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.inplace import ARRIVED_KEY


def main(address: str, prefix: str, rank: int, world: int, out: str) -> int:
    seen: dict[str, object] = {}

    def say(**what: object) -> None:
        seen.update(what, at=time.time())
        with open(out, "w") as f:
            json.dump(seen, f)

    host, _, port = address.rpartition(":")
    store = dist.PrefixStore(prefix, dist.TCPStore(host, int(port), is_master=False,
                                                   timeout=timedelta(seconds=30)))
    say(arrived=int(store.add(ARRIVED_KEY, 1)))
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    except Exception as exc:  # noqa: BLE001 - what stopped it is the report
        say(joined=False, error=f"{type(exc).__name__}: {exc}")
        return 0
    say(joined=True)
    shown = [torch.zeros(32, dtype=torch.uint8) for _ in range(world)]
    try:
        dist.all_gather(shown, torch.full((32,), 7, dtype=torch.uint8))
        say(gathered=True)
        time.sleep(30)
    except Exception as exc:  # noqa: BLE001
        say(gathered=False, error=f"{type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
