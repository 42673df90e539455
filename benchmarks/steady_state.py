"""Steady-state cost of the elastic loops: bare DDP vs the drop-in blocks vs ElasticTrainer.

    python -m benchmarks.steady_state --out benchmarks/results/steady_state

Side by side in one run, on trainer/examples/mlp.py's model, optimizer and batch (16 per
rank, float32), 2 ranks under ``torchrun --standalone --nproc-per-node=2`` (gloo, CPU,
``OMP_NUM_THREADS=1``), one launch of ``benchmarks/steady_worker.py`` per cell:

    bare         plain DDP loop indexing the tensors              (ElasticTrainer's baseline)
    bare-loader  plain DDP loop, DataLoader + DistributedSampler  (the drop-in's baseline)
    dropin       that loop + ElasticDistributedSampler + ElasticState.step_done(loss)
    trainer      ElasticTrainer, as mlp.py builds it
    trainer-noreseed  the same without the per-step reseed (TrainConfig.reseed_each_step=False),
                 a diagnostic: what the per-step reseed costs in place

at two step sizes: ``tiny`` (the MLP step alone, --tiny-steps timed steps) and ``50ms``
(the same step plus a 50 ms sleep inside it standing in for GPU compute, --sleep-steps),
each after a warm-up. Repetitions interleave the variants (ABCD ABCD ABCD) so a burst of
load on the shared machine hits them alike. Per cell: the median steps/s over repetitions,
the ratio to its baseline and the overhead ms/step = 1000/variant - 1000/baseline.
Target: ratio >= 0.98 at 50 ms for ``dropin`` and ``trainer``.

Then ``--mode pieces``: each per-step piece of the elastic loops timed alone, 2 ranks,
interleaved rounds (the old blocking agreement vs the async one, posted every step and at
its cadence; the progress file rate-limited vs rewritten every step, the log line, the
per-step reseed, the WorldLR hooks, the samplers), and an account of where the measured
overhead goes.

Writes NAME.json (settings, machine, load, every run; rewritten after each) and NAME.md.
Every launch's process tree is killed when it ends (the harness is the child subreaper:
torchrun's workers, in their own sessions, are re-parented to it if torchrun dies first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.mttr import loadavg, machine, wait_quiet
from benchmarks.steady_worker import PIECES
from elasticd import proctree

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("bare", "bare-loader", "dropin", "trainer", "trainer-noreseed")
BASELINE = {"bare-loader": "bare", "dropin": "bare-loader", "trainer": "bare",
            "trainer-noreseed": "bare"}
TARGETS = ("dropin", "trainer")  # held to TARGET_RATIO at the sleeping step
TARGET_RATIO = 0.98
LOG_EVERY = 10  # the loops' default: a progress line every 10 steps


def sizes(args: argparse.Namespace) -> dict[str, dict[str, float | int]]:
    """Step size label -> its sleep, timed steps and warm-up."""
    sleep_label = f"{round(1000 * args.step_sleep)}ms"
    return {"tiny": {"sleep": 0.0, "steps": args.tiny_steps, "warmup": args.tiny_warmup},
            sleep_label: {"sleep": args.step_sleep, "steps": args.sleep_steps,
                          "warmup": args.sleep_warmup}}


def worker_env(progress_file: str) -> dict[str, str]:
    """The harness's environment without any ELASTICD_* setting but the progress file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=str(REPO), ELASTICD_PROGRESS_FILE=progress_file)
    return env


def launch(worker_args: list[str], timeout_s: float, nproc: int = 2) -> dict[str, Any]:
    """One torchrun launch of the worker; its result JSON (or why there is none)."""
    with tempfile.TemporaryDirectory(prefix="steady-") as tmp:
        out, log_path = Path(tmp, "result.json"), Path(tmp, "torchrun.log")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "--monitor-interval=0.1",
               "-m", "benchmarks.steady_worker", *worker_args, "--out", str(out)]
        load_before = loadavg()
        started = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(str(Path(tmp, "progress.json"))),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                left = kill_all(proc.pid)
        run: dict[str, Any] = {"rc": rc, "wall_s": round(time.monotonic() - started, 2),
                               "load_before": load_before, "load_after": loadavg()}
        if left:
            run["survivors"] = left
        if rc == 0 and out.exists():
            run["result"] = json.loads(out.read_text())
        else:
            run["error"] = "timeout" if rc is None else f"exit code {rc}"
            run["log_tail"] = log_path.read_text(errors="replace")[-3000:]
        return run


def kill_all(pid: int) -> list[int]:
    """Kill ``pid``'s tree and any orphan re-parented to us; the pids that survived."""
    left = proctree.kill_tree(pid)
    left += proctree.kill_processes(proctree.descendants())
    proctree.reap_children()
    return [p.pid for p in left]


def variant_args(variant: str, size: dict[str, float | int]) -> list[str]:
    return ["--mode", variant, "--steps", str(size["steps"]), "--warmup", str(size["warmup"]),
            "--step-sleep", str(size["sleep"])]


# -- summary ---------------------------------------------------------------------------

def cells(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """size -> variant -> steps/s per repetition, median, ratio and overhead vs its baseline."""
    rates: dict[str, dict[str, dict[int, float]]] = {}
    per_step: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        if "result" in run and run["variant"] in VARIANTS:
            rates.setdefault(run["size"], {}).setdefault(run["variant"], {})[run["rep"]] = (
                run["result"]["steps_per_s"])
            for key in ("step_ms_p50", "cpu_ms_per_step"):
                per_step.setdefault((run["size"], run["variant"], key), []).append(
                    run["result"].get(key, float("nan")))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for size, by_variant in rates.items():
        out[size] = {}
        for variant, per_rep in by_variant.items():
            # Two more views that load moves less than the wall-clock rate: the median step
            # (a few stalled steps do not move it) and rank 0's CPU time per step.
            cell: dict[str, Any] = {"steps_per_s": [per_rep[r] for r in sorted(per_rep)],
                                    "median": statistics.median(per_rep.values()),
                                    **{key: statistics.median(per_step[size, variant, key])
                                       for key in ("step_ms_p50", "cpu_ms_per_step")}}
            base = by_variant.get(BASELINE.get(variant, ""))
            if base:
                base_median = statistics.median(base.values())
                # Paired by repetition: a variant and its baseline ran minutes apart at most.
                paired = [per_rep[r] / base[r] for r in sorted(per_rep) if r in base]
                cell.update(baseline=BASELINE[variant], ratio=cell["median"] / base_median,
                            ratio_per_rep=paired,
                            overhead_ms=1000 / cell["median"] - 1000 / base_median,
                            cpu_overhead_ms=cell["cpu_ms_per_step"]
                            - statistics.median(per_step[size, BASELINE[variant], "cpu_ms_per_step"]))
            out[size][variant] = cell
    return out


def verdicts(table: dict[str, dict[str, dict[str, Any]]], sleep_label: str) -> dict[str, str]:
    """``met``/``missed`` (or ``no data``) per target variant at the sleeping step."""
    at = table.get(sleep_label, {})
    return {v: ("no data" if "ratio" not in at.get(v, {}) else
                "met" if at[v]["ratio"] >= TARGET_RATIO else "missed") for v in TARGETS}


def piece_us(pieces: dict[str, Any], name: str) -> float | None:
    return pieces[name]["us"] if name in pieces else None


def derived(pieces: dict[str, Any]) -> dict[str, float]:
    """Costs that are the difference of two pieces, or a piece amortised over LOG_EVERY steps."""
    pairs = {"WorldLR hooks (optimizer.step with - without)": ("optimizer_step_worldlr",
                                                                "optimizer_step"),
             "ElasticDistributedSampler + advance vs DistributedSampler, per batch":
                 ("elastic_sampler_batch", "dist_sampler_batch"),
             "ElasticTrainer's indices vs the bare loop's": ("trainer_indices", "bare_indices"),
             "blocking step_boundary - async Agreement.post (saved per step)":
                 ("step_boundary", "agreement_post"),
             "a post every step - the default cadence (saved per step)":
                 ("agreement_post", "agreement_cadenced"),
             "progress file every step - rate-limited (saved per step)":
                 ("progress_every_step", "progress_rate_limited"),
             "the generator's seeding alone (step_seed + reseed - step_seed)":
                 ("step_seed_reseed", "step_seed")}
    out = {label: pieces[a]["us"] - pieces[b]["us"] for label, (a, b) in pairs.items()
           if a in pieces and b in pieces}
    line = piece_us(pieces, "progress_log_line")
    if line is not None:
        out[f"progress log line amortised over log_every={LOG_EVERY}"] = line / LOG_EVERY
    return out


# The per-step work each elastic variant adds to its baseline, as pieces (difference pairs).
ACCOUNTS = {
    "dropin": [("ElasticState.step_done", "step_done", None),
               ("WorldLR hooks", "optimizer_step_worldlr", "optimizer_step"),
               ("ElasticDistributedSampler", "elastic_sampler_batch", "dist_sampler_batch")],
    "trainer": [("end_step (= step_done)", "step_done", None),
                ("step_seed + reseed", "step_seed_reseed", None),
                ("WorldLR hooks", "optimizer_step_worldlr", "optimizer_step"),
                ("ElasticSampler indices + shard", "trainer_indices", "bare_indices")],
}


def accounts(pieces: dict[str, Any], table: dict[str, dict[str, dict[str, Any]]]
             ) -> dict[str, dict[str, Any]]:
    """Per target variant: its pieces (µs), their sum, and the measured overhead per size."""
    out: dict[str, dict[str, Any]] = {}
    for variant, parts in ACCOUNTS.items():
        items = {}
        for label, plus, minus in parts:
            if plus in pieces and (minus is None or minus in pieces):
                items[label] = pieces[plus]["us"] - (pieces[minus]["us"] if minus else 0.0)
        measured = {size: 1000 * by_variant[variant]["overhead_ms"]
                    for size, by_variant in table.items() if "overhead_ms" in by_variant.get(variant, {})}
        out[variant] = {"pieces_us": items, "sum_us": sum(items.values()), "measured_us": measured}
    return out


def summarize(runs: list[dict[str, Any]], sleep_label: str) -> dict[str, Any]:
    table = cells(runs)
    pieces = next((r["result"]["pieces"] for r in runs if r["variant"] == "pieces" and "result" in r),
                  {})
    return {"cells": table, "verdicts": verdicts(table, sleep_label), "pieces": pieces,
            "derived_us": derived(pieces), "accounts": accounts(pieces, table)}


# -- report ----------------------------------------------------------------------------

def markdown(result: dict[str, Any]) -> str:
    s, summary = result["settings"], result["summary"]
    ran = len({r["rep"] for r in result["runs"] if r["variant"] != "pieces"})
    lines = ["# Steady-state cost: bare DDP vs the drop-in blocks vs ElasticTrainer", "",
             f"`python -m benchmarks.steady_state {s['argv']}` on {result['machine']['cpus']} CPUs "
             f"({result['machine']['cpu_model']}), torch {result['machine']['torch']}, 2 ranks, gloo, "
             f"OMP_NUM_THREADS=1; {ran} of {s['reps']} interleaved repetitions ran; load average "
             f"{result['load_start'][0]:.1f} at the start, {result.get('load_end', ['?'])[0]} at the end. "
             "mlp.py's model (10-50-1), SGD momentum 0.9, 16 samples per rank per step; the "
             "sleeping step sleeps inside the model's forward (a pre-hook, the same in every loop).",
             "", "| step | variant | baseline | steps/s median (min–max) | ratio (per rep) "
             "| overhead ms/step | median step ms | rank-0 CPU ms/step (overhead) |",
             "|---|---|---|---|---|---|---|---|"]
    for size, by_variant in summary["cells"].items():
        for variant in VARIANTS:
            cell = by_variant.get(variant)
            if cell is None:
                continue
            rates = cell["steps_per_s"]
            ratio = overhead = "—"
            cpu = f"{cell['cpu_ms_per_step']:.3f}"
            if "ratio" in cell:
                cpu += f" ({cell['cpu_overhead_ms']:+.3f})"
                reps = ", ".join(f"{r:.3f}" for r in cell["ratio_per_rep"])
                ratio = f"**{cell['ratio']:.3f}** ({reps})"
                overhead = f"{cell['overhead_ms']:+.3f}"
            lines.append(f"| {size} | {variant} | {cell.get('baseline', '—')} | {cell['median']:.1f} "
                         f"({min(rates):.1f}–{max(rates):.1f}) | {ratio} | {overhead} "
                         f"| {cell['step_ms_p50']:.2f} | {cpu} |")
    lines += ["", f"Target (ratio >= {TARGET_RATIO} at {s['sleep_label']}): "
              + ", ".join(f"{v} **{verdict}**" for v, verdict in summary["verdicts"].items()), ""]
    lines += pieces_section(summary)
    lines += accounts_section(summary, s["sleep_label"])
    return "\n".join(lines) + "\n"


def pieces_section(summary: dict[str, Any]) -> list[str]:
    pieces = summary["pieces"]
    if not pieces:
        return []
    lines = ["## The pieces, each timed alone", "",
             "2 ranks, rounds interleaved; µs per call = the median over rounds of each round's "
             "mean (the collective ones: each call timed alone, 2 ms of sleep apart, as a step "
             "would keep them apart).", "", "| piece | µs per step | rounds min–max | what |",
             "|---|---|---|---|"]
    for name, p in pieces.items():
        lines.append(f"| {name} | {p['us']:.1f} | {min(p['us_rounds']):.1f}–{max(p['us_rounds']):.1f} "
                     f"| {p['what']} |")
    lines += ["", "| derived | µs per step |", "|---|---|"]
    lines += [f"| {label} | {us:+.1f} |" for label, us in summary["derived_us"].items()]
    return [*lines, ""]


def accounts_section(summary: dict[str, Any], sleep_label: str) -> list[str]:
    lines = ["## Where the remaining time goes", "",
             "The per-step work each elastic loop adds to its baseline, from the pieces timed "
             "alone, against the overhead measured in the loops (in a loop the pieces share the "
             "CPU with the other rank and the gloo threads, so the sums are a guide, not an "
             "identity).", ""]
    for variant, acc in summary["accounts"].items():
        if not acc["pieces_us"]:
            continue
        parts = sorted(acc["pieces_us"].items(), key=lambda kv: -kv[1])
        listed = ", ".join(f"{label} {us:.0f}" for label, us in parts)
        measured = ", ".join(f"{size} {us:.0f} µs" for size, us in acc["measured_us"].items())
        lines.append(f"- **{variant}** (vs {BASELINE[variant]}): {listed}: sum "
                     f"**{acc['sum_us']:.0f} µs**; measured overhead {measured or '—'}. "
                     f"Largest: {parts[0][0]}.")
    return [*lines, ""]


# -- main ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "benchmarks/results/steady_state"),
                   help="results prefix: writes OUT.json and OUT.md")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiny-steps", type=int, default=2000)
    p.add_argument("--tiny-warmup", type=int, default=200)
    p.add_argument("--sleep-steps", type=int, default=200)
    p.add_argument("--sleep-warmup", type=int, default=20)
    p.add_argument("--step-sleep", type=float, default=0.05, help="the sleeping step's sleep (s)")
    p.add_argument("--pieces", default=",".join(PIECES), help="'' to skip the pieces")
    p.add_argument("--piece-iterations", type=int, default=2000)
    p.add_argument("--piece-collective-iterations", type=int, default=500)
    p.add_argument("--piece-rounds", type=int, default=5)
    p.add_argument("--run-timeout-s", type=float, default=300.0)
    p.add_argument("--wait-quiet-s", type=float, default=0.0,
                   help="first wait up to this long for a quiet machine (see --quiet-load)")
    p.add_argument("--quiet-load", type=float, default=0.8, help="the 1-min load that is quiet")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rewrite OUT.md from OUT.json (e.g. of a run cut short)")
    return p.parse_args(argv)


def report_only(json_path: Path, md_path: Path) -> None:
    """Re-summarise the runs in ``json_path`` and write the markdown (no launch)."""
    result = json.loads(json_path.read_text())
    result["summary"] = summarize(result["runs"], result["settings"]["sleep_label"])
    result.setdefault("load_end", loadavg())
    json_path.write_text(json.dumps(result, indent=1))
    md_path.write_text(markdown(result))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    proctree.become_subreaper()  # torchrun's workers are re-parented to us, not to init
    json_path, md_path = Path(f"{args.out}.json"), Path(f"{args.out}.md")
    if args.report_only:
        report_only(json_path, md_path)
        print(md_path.read_text())
        return 0
    json_path.parent.mkdir(parents=True, exist_ok=True)
    by_size = sizes(args)
    sleep_label = next(label for label in by_size if label != "tiny")
    result: dict[str, Any] = {
        "settings": {**vars(args), "argv": " ".join(sys.argv[1:] if argv is None else argv),
                     "sizes": by_size, "sleep_label": sleep_label, "baseline": BASELINE,
                     "target_ratio": TARGET_RATIO},
        "machine": machine(), "load_start": loadavg(), "runs": []}
    result["summary"] = summarize([], sleep_label)
    if args.wait_quiet_s > 0:
        result["quiet_wait"] = wait_quiet(args.wait_quiet_s, args.quiet_load)

    def record(run: dict[str, Any]) -> None:
        result["runs"].append(run)
        result["summary"] = summarize(result["runs"], sleep_label)
        json_path.write_text(json.dumps(result, indent=1))
        got = run.get("result", {}).get("steps_per_s")
        print(f"rep {run['rep']} {run['size']:>5} {run['variant']:<11} "
              f"{f'{got:.1f} steps/s' if got else run.get('error', 'done')} ({run['wall_s']} s)",
              file=sys.stderr, flush=True)

    try:
        for rep in range(args.reps):
            for label, size in by_size.items():
                for variant in args.variants.split(","):
                    run = launch(variant_args(variant, size), args.run_timeout_s)
                    record({"rep": rep, "size": label, "variant": variant, **run})
        if args.pieces:
            run = launch(["--mode", "pieces", "--pieces", args.pieces,
                          "--iterations", str(args.piece_iterations),
                          "--collective-iterations", str(args.piece_collective_iterations),
                          "--rounds", str(args.piece_rounds)], args.run_timeout_s)
            record({"rep": 0, "size": "-", "variant": "pieces", **run})
    finally:  # Ctrl-C mid-launch: nothing of ours outlives the harness
        with contextlib.suppress(Exception):
            proctree.kill_processes(proctree.descendants())
    result["load_end"] = loadavg()
    json_path.write_text(json.dumps(result, indent=1))
    md_path.write_text(markdown(result))
    print(md_path.read_text())
    left = [p.pid for p in proctree.descendants()]
    if left:
        print(f"processes left behind: {left}", file=sys.stderr)
    return 0 if all(v == "met" for v in result["summary"]["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
