"""How long does a checkpoint stall training? torch.save vs CheckpointManager vs the floor.

For an MLP of about 10M and about 100M fp32 parameters trained with Adam (state = weights +
two moments, ~12 bytes per parameter), each method runs over a window of K training steps
that starts with one save:

    none      no save (the baseline)
    sync      torch.save(state, path) + fsync, in the training thread
    blocking  CheckpointManager.save(blocking=True): atomic, hashed, durable commit
    async     CheckpointManager.save(blocking=False) + K steps + wait(): the snapshot, then
              the background write competing with training for the CPU
    floor     copy of the state into preallocated buffers (the least a consistent
              snapshot can cost)
    async_nice_N  (with --extra-nice N,...) async with another writer_nice, to compare

stall = window time of the method - mean of the baseline windows just before and after
it; medians over repetitions. K is chosen so
the background write finishes inside the window (the final wait() is included, so a write
that does not finish would be counted). Methods are interleaved within each repetition so
that drift of the machine hits all of them alike.

    python benchmarks/checkpoint_stall.py [--sizes 10,100] [--reps 3] [--dir DIR]

Writes benchmarks/results/checkpoint_stall.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpointing import CheckpointManager  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {10: (1024, 10), 100: (2048, 24)}  # millions of params -> (width, layers)


class Workload:
    """An MLP, its Adam optimizer and one fixed batch."""

    def __init__(self, millions: int, batch: int = 16) -> None:
        width, layers = SHAPES[millions]
        torch.manual_seed(0)
        blocks = [torch.nn.Linear(width, width) for _ in range(layers)]
        self.model = torch.nn.Sequential(*[m for b in blocks for m in (b, torch.nn.ReLU())])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.batch = torch.randn(batch, width)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.step()  # materialize Adam's moments

    def step(self) -> None:
        self.model(self.batch).pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in _tensors(self.state()))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    return []


class Methods:
    """The save methods under test; each returns when the training loop may go on."""

    def __init__(self, work: Workload, directory: Path, extra_nice: list[int | None]) -> None:
        self.work = work
        self.directory = directory
        self.managers = {"async": CheckpointManager(directory / "managed", keep_last=2)}
        for nice in extra_nice:
            self.managers[f"async_nice_{nice}"] = CheckpointManager(
                directory / f"managed-{nice}", keep_last=2, writer_nice=nice)
        self.names = ["none", "floor", *self.managers, "sync", "blocking"]
        self.floor_buffers = [torch.empty_like(t) for t in _tensors(work.state())]
        self.count = 0

    def manager(self, name: str) -> CheckpointManager:
        return self.managers.get(name, self.managers["async"])

    def run(self, name: str) -> None:
        if name in self.managers:
            self.count += 1
            self.managers[name].save(self.count, self.work.state(), blocking=False)
        else:
            getattr(self, name)()

    def none(self) -> None:
        pass

    def floor(self) -> None:
        with torch.no_grad():
            for dst, src in zip(self.floor_buffers, _tensors(self.work.state()), strict=True):
                dst.copy_(src)

    def sync(self) -> None:
        path = self.directory / f"plain-{self.count % 2}.pt"
        torch.save(self.work.state(), path)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def blocking(self) -> None:
        self.count += 1
        self.managers["async"].save(self.count, self.work.state(), blocking=True)

    def close(self) -> None:
        for manager in self.managers.values():
            manager.close()


def _cpu_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet(max_wait: float, threshold: float = 0.15) -> float:
    """Wait until other processes use < `threshold` of the CPUs (this machine is shared);
    returns the busy fraction seen last, so noisy windows can be flagged."""
    deadline = time.monotonic() + max_wait
    while True:
        busy0, total0 = _cpu_busy()
        time.sleep(0.3)
        busy1, total1 = _cpu_busy()
        busy = (busy1 - busy0) / max(total1 - total0, 1)
        if busy < threshold or time.monotonic() > deadline:
            return busy


def timed_window(work: Workload, methods: Methods, name: str, steps: int,
                 quiet_wait: float) -> dict[str, float]:
    """Wall time of: one save by `name`, `steps` training steps, then wait() for the write."""
    busy_before = wait_for_quiet(quiet_wait)
    manager = methods.manager(name)
    writing_steps = 0
    start = time.perf_counter()
    methods.run(name)
    returned = time.perf_counter()
    for _ in range(steps):
        work.step()
        writing_steps += manager.writing
    before_wait = time.perf_counter()
    manager.wait()
    end = time.perf_counter()
    return {"window": end - start, "call": returned - start, "final_wait": end - before_wait,
            "steps_with_write_running": writing_steps, "busy_before": busy_before}


def choose_steps(work: Workload, methods: Methods) -> tuple[int, float]:
    """Median step time, and a window long enough for a background write to finish in."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        work.step()
        times.append(time.perf_counter() - t)
    step_time = statistics.median(times)
    most = 0
    for name in methods.managers:  # also allocates each manager's snapshot buffers
        methods.run(name)
        steps = 0
        while methods.manager(name).writing:
            work.step()
            steps += 1
        most = max(most, steps)
    return max(4, int(most * 1.5) + 2), step_time


def measure(millions: int, reps: int, root: Path, quiet_wait: float,
            extra_nice: list[int | None]) -> dict[str, Any]:
    work = Workload(millions)
    directory = Path(tempfile.mkdtemp(prefix=f"stall-{millions}m-", dir=root))
    try:
        methods = Methods(work, directory, extra_nice)
        steps, step_time = choose_steps(work, methods)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods.names}
        for _ in range(reps):
            # none, A, none, B, ..., none: each save window is compared with the baseline
            # windows right before and after it, which cancels slow drift of the machine.
            previous = timed_window(work, methods, "none", steps, quiet_wait)
            runs["none"].append(previous)
            for name in methods.names[1:]:
                window = timed_window(work, methods, name, steps, quiet_wait)
                after = timed_window(work, methods, "none", steps, quiet_wait)
                window["stall"] = window["window"] - (previous["window"] + after["window"]) / 2
                runs[name].append(window)
                runs["none"].append(after)
                previous = after
        methods.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return summarize(work, runs, steps, step_time)


def summarize(work: Workload, runs: dict[str, list[dict[str, float]]], steps: int,
              step_time: float) -> dict[str, Any]:
    base = statistics.median(r["window"] for r in runs["none"])
    noise = (max(r["window"] for r in runs["none"]) - min(r["window"] for r in runs["none"]))
    out: dict[str, Any] = {
        "params": work.params, "state_bytes": work.state_bytes(), "window_steps": steps,
        "step_seconds": round(step_time, 4), "baseline_window_seconds": round(base, 4),
        "baseline_spread_seconds": round(noise, 4), "methods": {},
        "noisy_windows": sum(r["busy_before"] >= 0.15 for rs in runs.values() for r in rs),
    }
    for name in list(runs)[1:]:
        stalls = [r["stall"] for r in runs[name]]
        out["methods"][name] = {
            "stall_seconds": round(statistics.median(stalls), 4),
            "stall_runs": [round(s, 4) for s in stalls],
            "call_seconds": round(statistics.median(r["call"] for r in runs[name]), 4),
            "final_wait_seconds": round(max(r["final_wait"] for r in runs[name]), 4),
            "steps_with_write_running": max(r["steps_with_write_running"] for r in runs[name]),
        }
    floor = out["methods"]["floor"]["stall_seconds"]
    for m in out["methods"].values():
        m["stall_over_floor"] = round(m["stall_seconds"] / floor, 2) if floor > 0 else None
    return out


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Checkpoint stall (benchmarks/checkpoint_stall.py)",
        "",
        f"{results['machine']}; torch {results['torch']}; {results['reps']} repetitions, "
        "medians. Stall = extra wall time of the training steps spanning one save over the "
        "same steps without a save (background-write interference and the final wait "
        "included). floor = copy of the state into preallocated buffers.",
        "",
        "| params | state | step | window | method | stall (s) | call (s) | stall / floor "
        "| steps overlapping the write |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for size in results["sizes"]:
        for name, m in size["methods"].items():
            lines.append(
                f"| {size['params'] / 1e6:.1f}M | {size['state_bytes'] / 1e9:.2f} GB | "
                f"{size['step_seconds']:.3f} s | {size['window_steps']} steps | {name} | "
                f"{m['stall_seconds']:.3f} | {m['call_seconds']:.3f} | {m['stall_over_floor']} | "
                f"{m['steps_with_write_running']} |"
            )
    for size in results["sizes"]:
        ratio = size["methods"]["async"]["stall_over_floor"]
        verdict = "met" if ratio is not None and ratio <= 1.5 else "NOT met"
        lines.append("")
        lines.append(
            f"{size['params'] / 1e6:.0f}M: async stall / floor = {ratio} (target <= 1.5: "
            f"{verdict}); baseline window spread {size['baseline_spread_seconds']:.3f} s; "
            f"windows started under other load: {size['noisy_windows']}."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100", help="millions of parameters: 10,100")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write checkpoints (default: "
                        "a temporary directory under the results folder's disk)")
    parser.add_argument("--out", default=str(RESULTS / "checkpoint_stall"))
    parser.add_argument("--extra-nice", default="",
                        help="also measure async saves with these writer_nice values, e.g. "
                        "'0,none' (the plain 'async' row uses the manager's default)")
    parser.add_argument("--quiet-wait", type=float, default=20.0,
                        help="seconds to wait before each window for other load to stop")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.gettempdir())
    extra = [None if v == "none" else int(v) for v in args.extra_nice.split(",") if v]
    torch.set_flush_denormal(True)  # Adam's tiny second moments otherwise slow steps 10x
    started = time.perf_counter()
    results = {
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.platform()}",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "reps": args.reps,
        "checkpoint_dir": str(root),
        "sizes": [measure(int(s), args.reps, root, args.quiet_wait, extra)
                  for s in args.sizes.split(",")],
    }
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
