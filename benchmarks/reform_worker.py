"""One member of the grow prototype of ``benchmarks/reform.py`` (a DDP loop, gloo, CPU).

    python -m benchmarks.reform_worker NODE DIR MECHANISM STATE_MB STEP_SLEEP [HOST:PORT RANK SIZE]

A founding member (with ``HOST:PORT RANK SIZE``; rank 0 hosts that store, as torchrun's
rank 0 does) creates the group of generation 0.0 (``trainer.reform.create_group``) and
trains: an SGD-with-momentum model of ``STATE_MB`` MB of parameters (the state moved is
twice that: parameters and momentum), one DDP step after another. ``DIR/grow.json``
(``{"record": GenerationRecord JSON, "after_step": S}``, written by the benchmark) makes
every founder re-form after step S into the record's bigger world; a newcomer (no world
arguments: started warm, imports done, no group) enters that generation
(``reform.join_as_newcomer``). The holder of the newest state (rank 0) sends it to the
newcomer over the new group (``trainer.transfer.send_state``), DDP is rebuilt, and everyone
runs ``POST_STEPS`` more steps. Each member writes ``DIR/NODE.json``: the wall time each
step ended, the re-form's and the hand-over's durations and the mechanism.
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elasticd.contract.generation import GenerationId, GenerationRecord
from trainer import inplace, reform, transfer

TIMEOUT = timedelta(seconds=60)
CPU = torch.device("cpu")
POST_STEPS = 5
WIDTH = 256  # the model: Linear(WIDTH, WIDTH) layers until STATE_MB is reached
KEEP: list[object] = []


def make_model(state_mb: float) -> nn.Module:
    layers = max(1, round(state_mb * 2**20 / 4 / (WIDTH * WIDTH + WIDTH)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def main() -> None:
    node, folder, mechanism = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    state_mb, step_sleep = float(sys.argv[4]), float(sys.argv[5])
    model = make_model(state_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    out: dict = {"node": node, "steps": [], "state_bytes": 0}
    step = 0

    def train_step(ddp: nn.Module) -> None:
        nonlocal step
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        step += 1
        time.sleep(step_sleep)
        out["steps"].append([step, dist.get_world_size(), time.time()])

    def save() -> None:
        tmp = folder / f"{node}.tmp"
        tmp.write_text(json.dumps(out))
        os.replace(tmp, folder / f"{node}.json")

    plan_path = folder / "grow.json"
    if len(sys.argv) > 6:  # a founder
        host, _, port = sys.argv[6].rpartition(":")
        rank, size = int(sys.argv[7]), int(sys.argv[8])
        store = dist.TCPStore(host, int(port), is_master=rank == 0, timeout=TIMEOUT,
                              wait_for_workers=False)
        reform.create_group("gloo", store, rank, size, GenerationId(0, 0, "b"), TIMEOUT, None,
                            mechanism=mechanism)
        ddp = DistributedDataParallel(model)
        while True:
            train_step(ddp)
            save()
            if plan_path.exists():
                plan = json.loads(plan_path.read_text())
                if step >= plan["after_step"]:
                    break
        record = GenerationRecord.from_json(plan["record"])
        started = time.time()
        mech = reform.mechanism_for("gloo", [])
        if mech.name == reform.DESTROY_INIT:
            KEEP.append(ddp)  # its reducer would destroy the abandoned group (tdist.shutdown)
        mech.leave(10.0)
        mech.join(record, record.rank_of(node, 0), "gloo", CPU, TIMEOUT, 10.0,
                  newer=lambda: None)
    else:  # a newcomer: warm (imports done, model built), no group until it is named
        save()
        while not plan_path.exists():
            time.sleep(0.005)
        plan = json.loads(plan_path.read_text())
        record = GenerationRecord.from_json(plan["record"])
        started = time.time()
        reform.join_as_newcomer(record, record.rank_of(node, 0), "gloo", CPU, TIMEOUT, 10.0,
                                mechanism)
        mech = reform.mechanism_for("gloo", [])
        step = -1
    out["mechanism"] = mech.name
    out["reformed_s"] = time.time() - started
    handed = time.time()
    newest, holder, every = inplace.newest_state(step, CPU)
    needs = [r for r, s in enumerate(every) if s != newest]
    if dist.get_rank() == holder or dist.get_rank() in needs:
        mine = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        state = transfer.send_state(mine if dist.get_rank() == holder else None, holder, CPU, needs)
        if dist.get_rank() != holder:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            step = state["step"]
    out["handover_s"] = time.time() - handed
    out["state_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()) * 2
    ddp = DistributedDataParallel(model, init_sync=False)
    for _ in range(POST_STEPS):
        train_step(ddp)
    save()
    os._exit(0)  # no teardown: an abandoned group's destructors may wait (see tdist.shutdown)


if __name__ == "__main__":
    main()
