"""A chaos run's report: ``chaos.json`` (everything), ``chaos.md`` (two tables) and
``chaos.png`` (the timeline: world size per node, steps, faults, recoveries, checkpoints).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticd.lab.chaos.invariants import STALL_S, Check, FaultMetrics, rank0_records

if TYPE_CHECKING:
    from elasticd.lab.chaos.run import RunResult

WORLD_COLOURS = {1: "#9467bd", 2: "#ff7f0e", 3: "#1f77b4", 4: "#2ca02c", 5: "#8c564b"}


def replay_command(scenario_file: Path) -> str:
    """The command line that runs the same scenario again (the report writes its file)."""
    return f"python -m elasticd.lab.chaos --scenario {scenario_file}"


def to_json(result: RunResult, checks: list[Check], metrics: list[FaultMetrics],
            scenario_file: Path) -> dict[str, Any]:
    by_index = {m.index: m for m in metrics}
    return {
        "passed": all(c.passed for c in checks),
        "seed": result.scenario.seed,
        "replay": replay_command(scenario_file),
        "scenario": result.scenario.to_dict(),
        "duration_s": round(result.t_end - result.t_start, 1),
        "t_start": result.t_start, "t_formed": result.t_formed,
        "exit_codes": result.exit_codes,
        "etcd": result.etcd,
        "faults": [f.to_dict() | {"metrics": by_index[f.index].to_dict() if f.index in by_index else None}
                   for f in result.faults],
        "invariants": [c.to_dict() for c in checks],
        "error": result.error,
    }


def _cell(x: Any) -> str:
    return "-" if x is None else str(x).replace("|", "/")


def _members(sc: dict[str, Any]) -> str:
    n = sc.get("etcd_members", 1)
    return f"{n} etcd member{'s' if n != 1 else ''}"


def to_markdown(report: dict[str, Any]) -> str:
    sc = report["scenario"]
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [f"# Chaos run: {verdict}", "",
             f"{sc['nodes']} nodes, {_members(sc)}, rendezvous rounds "
             f"`{sc.get('rounds', 'torch')}`, {len(sc['faults'])} faults, job of "
             f"{sc['final_step']} steps (checkpoint every {sc['every_steps']}), seed {report['seed']}, "
             f"{report['duration_s']} s; etcd: `{report.get('etcd') or '?'}`.", "",
             f"Replay: `{report['replay']}`", "",
             "| # | fault | target | at step | recovery s | back to full world s | steps lost "
             "| etcd outage s | detail |",
             "|---|---|---|---|---|---|---|---|---|"]
    for f in report["faults"]:
        m = f["metrics"] or {}
        detail = f["error"] or ", ".join(f"{k}={v}" for k, v in f["detail"].items())
        lines.append(f"| {f['index']} | {f['kind']} | {_cell(f['target'])} | {_cell(f['step'])} | "
                     f"{_cell(m.get('recovery_s'))} | {_cell(m.get('back_to_full_s'))} | "
                     f"{_cell(m.get('steps_lost'))} | {_cell(m.get('etcd_outage_s'))} | {_cell(detail)} |")
    lines += ["", "| invariant | result | detail |", "|---|---|---|"]
    for c in report["invariants"]:
        blame = f" (after fault {c['fault']})" if c["fault"] else ""
        lines.append(f"| {c['name']} | {'pass' if c['passed'] else 'FAIL'} | {_cell(c['detail'])}{blame} |")
    return "\n".join(lines) + "\n"


# A lane breaks where a node did not step for this long: longer than the invariants' stall,
# so that a loaded machine's slow steps do not shred the lanes.
LANE_GAP_S = 2.5 * STALL_S


def _segments(records: list[dict]) -> list[tuple[float, float, int]]:
    """(start, end, world size) runs of consecutive steps without an interruption."""
    out: list[tuple[float, float, int]] = []
    for r in records:
        if r["event"] not in ("step", "checkpoint"):
            continue
        t, w = r["time"], r["world_size"]
        if out and out[-1][2] == w and t - out[-1][1] <= LANE_GAP_S:
            out[-1] = (out[-1][0], t, w)
        else:
            out.append((t, t, w))
    return out


def draw(result: RunResult, metrics: list[FaultMetrics], png: Path, passed: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.t_formed or result.t_start
    names = sorted(result.progress)
    fig, (lanes, steps) = plt.subplots(2, 1, figsize=(15, 2.2 + 0.55 * len(names) + 3), sharex=True,
                                       gridspec_kw={"height_ratios": [0.55 * len(names) + 0.6, 3]})
    fig.subplots_adjust(right=0.76)
    seen_worlds = set()
    for y, name in enumerate(names):
        for start, end, world in _segments(result.progress[name]):
            seen_worlds.add(world)
            lanes.barh(y, max(end - start, 0.15), left=start - t0, height=0.6,
                       color=WORLD_COLOURS.get(world, "grey"))
    lanes.set_yticks(range(len(names)), [f"node {n}" for n in names])
    lanes.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=WORLD_COLOURS.get(w, "grey")) for w in sorted(seen_worlds)]
    lanes.legend(handles, [f"world {w}" for w in sorted(seen_worlds)], loc="upper right", fontsize=8, ncol=4)
    rank0 = rank0_records(result.progress)
    done = [r for r in rank0 if r["event"] in ("step", "checkpoint")]
    steps.plot([r["time"] - t0 for r in done], [r["step"] for r in done], ".", ms=1.5, color="black",
               label="rank-0 step")
    ckpts = [r for r in rank0 if r["event"] == "checkpoint"]
    steps.plot([r["time"] - t0 for r in ckpts], [r["step"] for r in ckpts], "|", color="red", ms=9,
               label="checkpoint")
    resumes = [r for r in rank0 if r["event"] == "resumed"]
    steps.plot([r["time"] - t0 for r in resumes], [r["step"] for r in resumes], "v", color="purple",
               ms=6, label="resumed from")
    by_index = {m.index: m for m in metrics}
    top = max((r["step"] for r in done), default=1)
    legend = []
    for f in result.faults:
        m = by_index.get(f.index)
        where = f" on {f.target}" if f.target else ""
        cost = f": {m.recovery_s} s, {m.steps_lost} lost" if m else f": {f.error}"
        legend.append(f"#{f.index} {f.kind}{where}{cost}")
        if f.t_inject is None:
            continue
        x = f.t_inject - t0
        for ax in (lanes, steps):
            ax.axvline(x, color="crimson", ls="--", lw=0.8)
        # Only the number by the line (faults come seconds apart); the list is beside.
        steps.text(x, top * (0.99 - 0.06 * (f.index % 3)), f"#{f.index}", fontsize=8, va="top",
                   color="crimson")
        if m and m.recovery_s:
            y = top * (0.03 + 0.04 * (f.index % 3))
            steps.annotate("", xy=(x + m.recovery_s, y), xytext=(x, y),
                           arrowprops={"arrowstyle": "->", "color": "green"})
    fig.text(0.775, 0.5, "faults (recovery, steps lost):\n" + "\n".join(legend), fontsize=8,
             va="center", family="monospace")
    steps.set_xlabel("seconds since the first world of all nodes")
    steps.set_ylabel("step")
    steps.legend(loc="lower right", fontsize=8)
    verdict = "every invariant holds" if passed else "an invariant FAILED (see chaos.md)"
    lanes.set_title(f"chaos, seed {result.scenario.seed}: {len(result.faults)} faults on "
                    f"{result.scenario.nodes} nodes; {verdict}", fontsize=10)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def write(result: RunResult, checks: list[Check], metrics: list[FaultMetrics], out: Path,
          stem: str = "chaos") -> dict[str, Any]:
    """Write ``<stem>.json``, ``.md``, ``.png`` and the scenario that replays the run
    (``<stem>.scenario.json``) under ``out``; returns the JSON report."""
    out.mkdir(parents=True, exist_ok=True)
    scenario_file = out / f"{stem}.scenario.json"
    scenario_file.write_text(json.dumps(result.scenario.to_dict(), indent=1) + "\n")
    report = to_json(result, checks, metrics, scenario_file)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{stem}.md").write_text(to_markdown(report))
    draw(result, metrics, out / f"{stem}.png", report["passed"])
    return report
