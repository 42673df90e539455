"""Do the workers compute alike? Identical fault-free 3-daemon jobs, repeated, compared bitwise.

    python -m benchmarks.alike --runs 20 --cold b --out benchmarks/results --name alike

Issue 29's finding 8: in 3 of 22 three-node runs one worker process computed losses 1e-9
to 5.6e-9 off the others' from step 1, before any fault, and the final model missed the
float64 replay by up to 1.8e-9 (every other run: 5e-16). This repeats one job (real etcd,
three `elasticd run` daemons, torchrun, gloo, the chaos oracle's float64 MLP with its
settings; warm starts as shipped, except on the ``--cold`` nodes, whose workers start cold,
so every run mixes the two kinds of process; no fault) and records, per run:

* each final worker's rank, warm or cold start, thread count and a sha256 of its final
  weights (``benchmarks/alike_worker.py``): DDP replicas must end bit-identical;
* the run's world-size history (the first round may form with fewer than 3 nodes and be
  restarted into 3) and the final checkpoint's relative difference from the single-process
  float64 replay of that history (``elasticd.lab.chaos.oracle``; the tests' tolerance is 1e-9);
* runs with the same history must end with the same weights, bit for bit.

Results: JSON (every run) and markdown (the table and the verdicts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from checkpointing import CheckpointManager
from elasticd.lab.chaos.invariants import rank0_records
from elasticd.lab.chaos.oracle import Run, lineage, norm_rel_diff, replay_run
from elasticd.lab.chaos.run import progress_records
from elasticd.lab.local_cluster import local_cluster, wait_for

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "benchmarks" / "alike_worker.py")
# The whole-job tests' job (tests/daemon/runs.py): float64, its LR for a world of 3.
RUN = Run(samples=300, batch=4, lr=0.05, seed=7, data_seed=11, momentum=0.9)
TOLERANCE = 1e-9


def entrypoint(final: int) -> list[str]:
    return [WORKER, *RUN.args(), f"--max-steps={final}", "--step-sleep=0.03", "--log-every=1",
            "--lr-rule=linear", "--lr-warmup-steps=2", "--lr-base-world-size=3"]


def one_run(index: int, final: int, root: Path, cold: str, stagger_s: float = 0.0) -> dict[str, Any]:
    """One fault-free job of three daemons to step ``final``; what it ended with. With
    ``stagger_s`` the nodes start that far apart: the first round forms with fewer than
    three and the job restarts into the bigger world (the start-up path of finding 7)."""
    alike = root / "alike"
    alike.mkdir(parents=True)
    t0 = time.monotonic()
    with local_cluster(root / "cluster") as cluster:
        nodes = []
        for i, n in enumerate("abc"):
            time.sleep(stagger_s if i else 0.0)
            nodes.append(cluster.daemon(n, f"alike-{index}", env={"ALIKE_DIR": str(alike)},
                                        entrypoint=entrypoint(final), warm_start=n not in cold))
        wait_for(lambda: all(n.proc.poll() is not None for n in nodes), 300,
                 "every daemon to exit once the job completed", nodes)
        codes = [n.proc.returncode for n in nodes]
        progress = {n.name: progress_records(n) for n in nodes}
    workers = sorted((json.loads(p.read_text()) for p in alike.glob("*.json")),
                     key=lambda w: w["rank"])
    return {"run": index, "exit_codes": codes, "wall_s": round(time.monotonic() - t0, 1),
            "workers": workers, **_against_replay(root / "cluster" / "ckpt", progress, final)}


def _against_replay(ckpt: Path, progress: dict[str, list[dict]], final: int) -> dict[str, Any]:
    history = {s: (r["world_size"], r["lr"]) for s, r in lineage(rank0_records(progress)).items()}
    worlds = [history[s][0] for s in sorted(history)]
    out: dict[str, Any] = {"worlds": _runs_of(worlds), "rel_diff": None}
    if sorted(history) != list(range(1, final + 1)):
        out["note"] = f"rank 0's lineage holds {len(history)} of steps 1..{final}: no replay"
        return out
    latest = CheckpointManager(ckpt, read_only=True).load_latest()
    if latest is None or latest.step != final:
        out["note"] = f"the newest checkpoint is not of step {final}"
        return out
    out["rel_diff"] = norm_rel_diff(latest.state["model"], replay_run(RUN, history).params)
    return out


def _runs_of(worlds: list[int]) -> list[list[int]]:
    """[[world, steps], ...]: the world-size history run-length encoded."""
    out: list[list[int]] = []
    for w in worlds:
        if out and out[-1][0] == w:
            out[-1][1] += 1
        else:
            out.append([w, 1])
    return out


def verdicts(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Replicas alike within each run, runs alike within each history, all within the oracle."""
    split = [r["run"] for r in runs if len({w["digest"] for w in r["workers"]}) > 1]
    by_history: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        by_history[json.dumps(r["worlds"])].append(r)
    apart = {h: sorted({r["workers"][0]["digest"][:12] for r in rs if r["workers"]})
             for h, rs in by_history.items()}
    diffs = [r["rel_diff"] for r in runs if r["rel_diff"] is not None]
    return {
        "runs": len(runs),
        "replicas_split": split,
        "histories": {h: len(rs) for h, rs in by_history.items()},
        "digests_per_history": apart,
        "rel_diff_max": max(diffs, default=None),
        "rel_diff_median": statistics.median(diffs) if diffs else None,
        "over_tolerance": [r["run"] for r in runs if (r["rel_diff"] or 0) >= TOLERANCE],
        "unreplayed": [r["run"] for r in runs if r["rel_diff"] is None],
        "warm_workers": sum(w["warm"] for r in runs for w in r["workers"]),
        "cold_workers": sum(not w["warm"] for r in runs for w in r["workers"]),
        "thread_counts": sorted({w["threads"] for r in runs for w in r["workers"]}),
    }


def markdown(report: dict[str, Any]) -> str:
    v = report["verdicts"]
    rows = ["| run | worlds (size x steps) | workers (rank: warm/cold, threads, digest) | vs replay |",
            "|---|---|---|---|"]
    for r in report["runs"]:
        workers = ", ".join(f"{w['rank']}: {'warm' if w['warm'] else 'cold'} {w['threads']}t "
                            f"{w['digest'][:8]}" for w in r["workers"])
        diff = "-" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"
        rows.append(f"| {r['run']} | {' '.join(f'{w}x{n}' for w, n in r['worlds'])} | {workers} | {diff} |")
    ok = not v["replicas_split"] and not v["over_tolerance"] and all(
        len(d) == 1 for d in v["digests_per_history"].values())
    return "\n".join([
        f"# Do the workers compute alike? ({v['runs']} fault-free 3-daemon runs, {report['date']})",
        "",
        f"Command: `{report['command']}`. Job: the chaos oracle's float64 MLP, {report['final']} steps.",
        "",
        "- replicas bit-identical at the end of every run: "
        + ("yes" if not v["replicas_split"] else f"NO, runs {v['replicas_split']}"),
        "- runs with the same world history end bit-identical: "
        + "; ".join(f"{h}: {n} runs, {len(v['digests_per_history'][h])} distinct weights"
                    for h, n in v["histories"].items()),
        f"- final checkpoint vs float64 replay: median {_e(v['rel_diff_median'])}, max "
        f"{_e(v['rel_diff_max'])} (tolerance 1e-9; over it: {v['over_tolerance'] or 'none'}; "
        f"not replayed: {v['unreplayed'] or 'none'})",
        f"- workers: {v['warm_workers']} warm, {v['cold_workers']} cold; thread counts {v['thread_counts']}",
        f"- verdict: {'workers computed alike in every run' if ok else 'workers did NOT compute alike'}",
        "", *rows, ""])


def _e(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--final", type=int, default=150, help="steps per run")
    p.add_argument("--cold", default="b", help="nodes (of a, b, c) whose workers start cold")
    p.add_argument("--stagger-s", type=float, default=0.0,
                   help="start the nodes this far apart (a first round of fewer than three)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="alike")
    args = p.parse_args(argv)
    runs = []
    for i in range(args.runs):
        with TemporaryDirectory(prefix=f"alike-{i}-") as tmp:
            runs.append(one_run(i, args.final, Path(tmp), args.cold, args.stagger_s))
        r = runs[-1]
        print(f"run {i}: worlds {r['worlds']} rel {r['rel_diff']} digests "
              f"{sorted({w['digest'][:8] for w in r['workers']})} codes {r['exit_codes']}", flush=True)
    report = {"command": "python -m benchmarks.alike " + " ".join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "final": args.final, "run": RUN.__dict__,
              "runs": runs, "verdicts": verdicts(runs)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
