"""The same MTTR cells on two checkouts of elasticd, side by side in one process tree.

Answers "is the recovery time of this change within noise of before?": for each seed, each
tree's ``benchmarks/mttr.py`` runs the same cells once, before and after alternating (so
drift of the machine hits both alike), each as a child of this process with its own tree on
``PYTHONPATH`` (its daemons, agents and workers import that tree's code). The report gives,
per cell, every run's recovery time, the medians and after/before, and the steps lost.

    python -m benchmarks.mttr_compare --before /tmp/before --after . --seeds 1 2 3 \\
        [--systems d] [--faults crash,rank0-crash] [--out benchmarks/results] [--name NAME]

``--before``: a checkout of the old commit (``git worktree add /tmp/before COMMIT``).
Writes ``NAME.json`` (every run of both trees, the commits) and ``NAME.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def commit_of(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def run_tree(tree: Path, seed: int, args: argparse.Namespace, scratch: Path) -> list[dict]:
    """One pass of the cells on ``tree``: its mttr.py with its own code on PYTHONPATH."""
    name = f"{tree.name}-seed{seed}"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / "mttr.py"), "--repeats", "1",
           "--seed", str(seed), "--systems", args.systems, "--faults", args.faults,
           "--out", str(scratch), "--name", name]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads((scratch / f"{name}.json").read_text())["runs"]


def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Per cell (system, row): each side's recovery times, medians, and after/before."""
    cells: dict[str, Any] = {}
    for side, side_runs in runs.items():
        for run in side_runs:
            cell = cells.setdefault(f"{run['system']}:{run['row']}", {"before": {}, "after": {}})
            mine = cell[side].setdefault("recovery_s", [])
            if run.get("recovery_s") is not None:
                mine.append(run["recovery_s"])
            cell[side].setdefault("steps_lost", []).append(run.get("steps_lost"))
            cell[side].setdefault("paths", []).append(run.get("path"))
    for cell in cells.values():
        for side in ("before", "after"):
            times = cell[side].get("recovery_s", [])
            cell[side]["median_s"] = round(statistics.median(times), 3) if times else None
        b, a = cell["before"]["median_s"], cell["after"]["median_s"]
        cell["after_over_before"] = round(a / b, 3) if a and b else None
        # "Within noise" as a rule, not a reading: after's median inside before's range.
        spread = cell["before"].get("recovery_s", [])
        cell["within_before_range"] = (a is not None and bool(spread)
                                       and min(spread) <= a <= max(spread))
    return cells


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# MTTR before/after: {report['before']['commit']} vs {report['after']['commit']}",
             "", f"`{report['command']}`; seeds {report['seeds']}, one run per cell and seed, "
             "before and after alternating.", "",
             "| cell | before: median s (runs) | after: median s (runs) | after/before | "
             "after's median in before's range | steps lost (before / after) | paths (after) |",
             "|---|---|---|---|---|---|---|"]
    for key, cell in report["cells"].items():
        b, a = cell["before"], cell["after"]
        lines.append(f"| {key} | {b['median_s']} ({', '.join(map(str, b['recovery_s']))}) | "
                     f"{a['median_s']} ({', '.join(map(str, a['recovery_s']))}) | "
                     f"{cell['after_over_before']} | "
                     f"{'yes' if cell['within_before_range'] else 'no'} | "
                     f"{b['steps_lost']} / {a['steps_lost']} | "
                     f"{', '.join(sorted(set(map(str, a['paths']))))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="checkout of the old commit")
    p.add_argument("--after", type=Path, default=REPO)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--systems", default="d")
    p.add_argument("--faults", default="crash,rank0-crash")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--name", default="mttr-compare")
    args = p.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    for side, tree in trees.items():
        if not (tree / "benchmarks" / "mttr.py").is_file():
            p.error(f"--{side} {tree}: no benchmarks/mttr.py there; give a checkout of elasticd")
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="mttr-compare-") as scratch:
        for i, seed in enumerate(args.seeds):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for side in order:
                runs[side] += [dict(r, seed=seed) for r in
                               run_tree(trees[side], seed, args, Path(scratch))]
                print(f"seed {seed} {side}: done", file=sys.stderr, flush=True)
    report = {"command": "python -m benchmarks.mttr_compare " + " ".join(argv or sys.argv[1:]),
              "seeds": args.seeds, "systems": args.systems, "faults": args.faults,
              **{side: {"tree": str(tree), "commit": commit_of(tree)} for side, tree in trees.items()},
              "cells": summarize(runs), "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
