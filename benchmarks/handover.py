"""What a join's state hand-over costs against the link it crosses (issue 26's target:
the members' pause <= 0.2 s + the state's bytes / the link's bandwidth).

One process tree: a gloo group of ``--world`` processes on loopback (rank 0 the holder,
the last rank a newcomer holding nothing, the others members at the newest step). For
each state size, in alternating order within each repetition:

    link       dist.send of the state's bytes as one uint8 tensor, holder -> newcomer:
               the link's floor (what the bytes cost on the wire, nothing else)
    handover   trainer.transfer.send_state of a state dict of that many bytes of float32
               tensors (the tensors' bytes sent as they are, point to point to the ranks
               that need it; only the structure serialized): what a join pays
    serialized the whole state through torch.save and torch.load in memory, sent point to
               point (send_state of 98ec0ea)
    broadcast  the same serialized state broadcast to every rank (send_state before
               98ec0ea; every member received it too)

Times are the holder's and the newcomer's wall clock from a barrier to the newcomer's
loaded state (max over ranks), medians over ``--repeats``; overhead = handover - link.

    python benchmarks/handover.py [--sizes-mb 16,256,1024] [--world 3] [--repeats 5]
        [--seed 1] [--name handover]

Writes benchmarks/results/NAME.json and NAME.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer import transfer  # noqa: E402 - after the path

METHODS = ("link", "handover", "serialized", "broadcast")
CHUNK = 1 << 24   # 16 MiB tensors make up the state (a model's parameters, roughly)


def _state(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n, left = CHUNK // 4, nbytes // 4
    return {f"p{i}": torch.randn(min(n, left - i * n), generator=gen)
            for i in range((left + n - 1) // n)}


def _serialized(state: dict | None, holder: int, newcomer: int) -> dict:
    """send_state of 98ec0ea: the whole state serialized, sent point to point."""
    if dist.get_rank() == holder:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), newcomer)
        dist.send(data, newcomer)
        return state
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, holder)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, holder)
    return torch.load(io.BytesIO(data.numpy()), weights_only=True)


def _broadcast(state: dict | None, holder: int) -> dict:
    """The former send_state: one broadcast of the serialized state to every rank."""
    payload = b""
    if dist.get_rank() == holder:
        buf = io.BytesIO()
        torch.save(state, buf)
        payload = buf.getvalue()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=holder)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
            else torch.empty(int(size.item()), dtype=torch.uint8))
    dist.broadcast(data, src=holder)
    return state if state is not None else torch.load(io.BytesIO(data.numpy().tobytes()),
                                                      weights_only=True)


def _one(method: str, nbytes: int, state: dict | None, rank: int, newcomer: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    if method == "link":
        data = torch.empty(nbytes, dtype=torch.uint8)
        if rank == 0:
            dist.send(data, newcomer)
        elif rank == newcomer:
            dist.recv(data, 0)
    elif method == "handover":
        if rank == 0:
            transfer.send_state(state, 0, torch.device("cpu"), [newcomer])
        elif rank == newcomer:
            got = transfer.send_state(None, 0, torch.device("cpu"), [newcomer])
            assert len(got) == len(state or got)
    elif method == "serialized":
        if rank in (0, newcomer):
            _serialized(state if rank == 0 else None, 0, newcomer)
    else:
        _broadcast(state if rank == 0 else None, 0)
    took = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    rng = random.Random(args.seed)
    rows = []
    for size_mb in args.sizes_mb:
        nbytes = size_mb << 20
        state = _state(nbytes, args.seed)   # every rank builds it: the holder's is sent
        for rep in range(args.repeats):
            order = list(METHODS)
            rng.shuffle(order)
            for method in order:
                rows.append({"size_mb": size_mb, "method": method, "rep": rep,
                             "s": _one(method, nbytes, state if rank == 0 else None, rank,
                                       world - 1)})
        del state
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def summarize(rows: list[dict], args: argparse.Namespace) -> dict:
    cells = {}
    for size_mb in args.sizes_mb:
        cell = {m: statistics.median(r["s"] for r in rows
                                     if r["size_mb"] == size_mb and r["method"] == m)
                for m in METHODS}
        link_bps = (size_mb << 20) / cell["link"]
        cell |= {"link_mb_per_s": round(link_bps / 2**20, 1),
                 "overhead_s": cell["handover"] - cell["link"],
                 "target_s": 0.2 + cell["link"],
                 "met": cell["handover"] <= 0.2 + cell["link"]}
        cells[str(size_mb)] = cell
    return {"world": args.world, "repeats": args.repeats, "seed": args.seed,
            "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                        "python": platform.python_version()}, "cells": cells, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# State hand-over vs the link (gloo, loopback, world {result['world']}, "
             f"seed {result['seed']}, median of {result['repeats']})", "",
             "| state | link (bytes alone) | hand-over (send_state) | serialized, point to point "
             "(98ec0ea) | broadcast to all (before 98ec0ea) | link MB/s | hand-over - link "
             "| target (0.2 s + link) |",
             "|---|---|---|---|---|---|---|---|"]
    for size, c in result["cells"].items():
        verdict = "met" if c["met"] else "**missed**"
        lines.append(f"| {size} MiB | {c['link']:.3f} s | {c['handover']:.3f} s | "
                     f"{c['serialized']:.3f} s | {c['broadcast']:.3f} s | {c['link_mb_per_s']:.0f} | "
                     f"{c['overhead_s']:+.3f} s | {c['target_s']:.3f} s: {verdict} |")
    lines += ["", "Holder rank 0, newcomer the last rank, the others members at the newest step; "
              "times from a barrier to the newcomer's loaded state, max over ranks "
              "(benchmarks/handover.py)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mb", type=lambda s: [int(x) for x in s.split(",")], default=[16, 256, 1024])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--name", default="handover")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args()
    raw = Path(args.out) / f".{args.name}.rows.json"
    port = 29000 + random.Random(args.seed).randrange(2000)
    mp.spawn(_worker, args=(args.world, port, args, str(raw)), nprocs=args.world, join=True)
    result = summarize(json.loads(raw.read_text()), args)
    raw.unlink()
    (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (Path(args.out) / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
