"""The in-place re-form on both mechanisms, side by side in one run: reconfigure vs destroy + init.

    python -m benchmarks.reform --seeds 1 2 3 --out benchmarks/results/reform

Run it under a torch that has the reconfigure API (2.14+: `make compat` builds
`.venv-torch2.14.1`); on 2.13 only destroy + init exists and the reconfigure cells say so.
Both mechanisms run in every repetition, alternating which goes first, on the same machine
and torch, as child processes of this one.

* **loss** (the real trainer): three single-worker "nodes" of `trainer/examples/mlp.py`
  (ElasticTrainer, gloo, in-place mode, `ELASTICD_REFORM=auto` or `destroy-init`); once
  they step, one (rank 0 or not, drawn from the seed) is SIGKILLed and this process writes
  the next generation to the survivors' generation files at once, standing in for the
  daemons (as tests/trainer/test_inplace.py does). Measured: from the record's write (the
  agreed generation) to each survivor's first completed step in the world of 2, and the
  workers' own `reformed.duration_s`.
* **grow** (a prototype: the trainer has no in-place join yet): two founders train a DDP
  model of `--state-mb` MB (`benchmarks/reform_worker.py`); a newcomer starts warm (imports
  done, model built, no group); the record of the world of 3 names the step after which
  the founders re-form; the newcomer enters it, rank 0 sends it the whole state (model and
  momentum, 2 x state-mb) over the new group, DDP is rebuilt and the world of 3 steps.
  Measured: the **pause**, from the last founder's last step of the world of 2 to the last
  member's first step of the world of 3, split into the re-form and the hand-over; and the
  link bandwidth of the hand-over (its bytes / its time).

Targets (issues 24 and 26): a loss re-formed within the in-place budget of a crash (1 s
from the fault, 0.3 s of which is detection: so <= 0.7 s from the agreed generation to the
first step); a join's pause <= 0.2 s plus the state's bytes over the measured link
bandwidth. Results: JSON (every run) and markdown (medians, min-max), met or missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import torch.distributed as dist

from elasticd import proctree
from elasticd.contract.generation import GenerationId, GenerationRecord, renumber, shrink
from elasticd.inplace.handover import hand_over
from elasticd.lab.embedded_etcd import free_port
from elasticd.rendezvous import torch_compat
from trainer import reform

REPO = Path(__file__).resolve().parents[1]
MLP = REPO / "trainer" / "examples" / "mlp.py"
MECHANISMS = (reform.RECONFIGURE, reform.DESTROY_INIT)
EPOCH = "bench"
LOSS_BUDGET_S = 0.7   # 1 s from a crash to the first step, less 0.3 s of detection
JOIN_BASE_S = 0.2     # a join's pause: this plus the state's bytes over the link
CAP_S = 60.0


def _env(mechanism: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                CUDA_VISIBLE_DEVICES="",
                ELASTICD_REFORM="auto" if mechanism == reform.RECONFIGURE else mechanism)


def _json_lines(path: Path) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGCONT)
            proctree.kill_tree(p.pid)
        p.wait()


def run_loss(tmp: Path, mechanism: str, victim_rank0: bool) -> dict:
    """One loss on the real trainer; see the module docstring."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    base = GenerationRecord(GenerationId(0, 0, EPOCH), renumber((f"n{r}", 1) for r in range(3)))
    port, procs, logs = free_port(), [], []
    for rank in range(3):
        node = f"n{rank}"
        env = dict(_env(mechanism), RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="3",
                   LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), ELASTICD_NODE_ID=node, ELASTICD_GENERATION="0",
                   ELASTICD_GENERATION_EPOCH=EPOCH, ELASTICD_RECOVERY_MODE="in-place",
                   ELASTICD_RECOVERY_BOUND_S="10",
                   ELASTICD_GENERATION_FILE=str(tmp / f"{node}.generation.json"))
        logs.append(tmp / f"{node}.log")
        with open(logs[-1], "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(MLP), "--log-every=1", "--max-steps=100000",
                 "--step-sleep=0.05", "--dtype=float64", "--lr-rule=linear"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        def steps(i: int) -> list[dict]:
            return [r for r in _json_lines(logs[i]) if r.get("kind") == "progress"
                    and r.get("event") == "step"]

        if not proctree.wait_for(lambda: all(len(steps(i)) >= 20 for i in range(3)), CAP_S):
            return {"error": "the world of 3 did not step"}
        victim = 0 if victim_rank0 else 1
        os.killpg(procs[victim].pid, signal.SIGKILL)
        record = shrink(base, [f"n{victim}"], {f"n{r}": f"127.0.0.1:{store.port}"
                                               for r in range(3)}, cause="peer-crashed")
        assert record is not None
        agreed = time.time()
        for node in record.nodes:
            hand_over(str(tmp / f"{node}.generation.json"), record)
        survivors = [i for i in range(3) if i != victim]

        def first_new(i: int) -> dict | None:
            return next((r for r in steps(i) if r["world_size"] == 2), None)

        if not proctree.wait_for(lambda: all(first_new(i) for i in survivors), CAP_S):
            return {"error": "no step in the world of 2", "victim": victim}
        reformed = [next((r for r in _json_lines(logs[i]) if r.get("event") == "reformed"), {})
                    for i in survivors]
        old = [r["time"] for r in steps(survivors[0]) if r["world_size"] == 3]
        return {
            "victim": f"n{victim}", "rank0": victim_rank0,
            "to_first_step_s": max(first_new(i)["time"] for i in survivors) - agreed,
            "reformed_s": max(r.get("duration_s", float("nan")) for r in reformed),
            "used": sorted({r.get("mechanism") for r in reformed}),
            "step_s": statistics.median(b - a for a, b in zip(old[-10:], old[-9:], strict=False)),
        }
    finally:
        _kill_all(procs)


def run_grow(tmp: Path, mechanism: str, state_mb: float, after: int) -> dict:
    """One grow of the prototype; see the module docstring."""
    world, stores = f"127.0.0.1:{free_port()}", dist.TCPStore("127.0.0.1", 0, is_master=True,
                                                               wait_for_workers=False)
    cmd = [sys.executable, "-m", "benchmarks.reform_worker"]
    args = [str(tmp), mechanism if mechanism == reform.DESTROY_INIT else "auto",
            str(state_mb), "0.05"]
    procs = []
    for node, extra in (("n0", [world, "0", "2"]), ("n1", [world, "1", "2"]), ("n2", [])):
        with open(tmp / f"{node}.log", "wb") as out:
            procs.append(subprocess.Popen([*cmd, node, *args, *extra], env=_env(mechanism),
                                          cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))

    def result(node: str) -> dict:
        path = tmp / f"{node}.json"
        return json.loads(path.read_text()) if path.exists() else {"steps": []}

    try:
        if not proctree.wait_for(lambda: all(len(result(n)["steps"]) >= after // 2
                                             for n in ("n0", "n1"))
                                 and (tmp / "n2.json").exists(), CAP_S):
            return {"error": "the founders did not step, or the newcomer did not start"}
        record = GenerationRecord(GenerationId(0, 1, "b"), renumber((n, 1) for n in
                                                                    ("n0", "n1", "n2")),
                                  store=f"127.0.0.1:{stores.port}")
        (tmp / "grow.tmp").write_text(json.dumps({"record": record.to_json(),
                                                  "after_step": after}))
        os.replace(tmp / "grow.tmp", tmp / "grow.json")
        done = proctree.wait_for(lambda: all("handover_s" in result(n) and
                                             len([s for s in result(n)["steps"] if s[1] == 3])
                                             >= 1 for n in ("n0", "n1", "n2")), CAP_S)
        if not done:
            return {"error": "no step in the world of 3"}
        res = {n: result(n) for n in ("n0", "n1", "n2")}
        last_old = max(s[2] for n in ("n0", "n1") for s in res[n]["steps"] if s[1] == 2)
        first_new = max(next(s[2] for s in res[n]["steps"] if s[1] == 3) for n in res)
        old = [s[2] for s in res["n0"]["steps"] if s[1] == 2]
        handover = max(r["handover_s"] for r in res.values())
        return {
            "pause_s": first_new - last_old,
            # the founders' (the newcomer waited from the record's publication on)
            "reformed_s": max(res[n]["reformed_s"] for n in ("n0", "n1")),
            "handover_s": handover,
            "state_bytes": res["n0"]["state_bytes"],
            "bandwidth_Bps": res["n0"]["state_bytes"] / handover if handover > 0 else None,
            "used": sorted({r["mechanism"] for r in res.values()}),
            "step_s": statistics.median(b - a for a, b in zip(old[-10:], old[-9:], strict=False)),
        }
    finally:
        _kill_all(procs)


def run_all(seeds: list[int], reps: int, state_mbs: list[float]) -> list[dict]:
    runs = []
    for seed in seeds:
        rng = random.Random(seed)
        for rep in range(reps):
            order = MECHANISMS if (seed + rep) % 2 == 0 else MECHANISMS[::-1]
            cells = [("loss", {"victim_rank0": rng.random() < 0.5})]
            cells += [("grow", {"state_mb": mb, "after": 20 + rng.randrange(10)})
                      for mb in state_mbs]
            for scenario, kw in cells:
                for mechanism in order:
                    if mechanism == reform.RECONFIGURE and not torch_compat.reconfigure_api():
                        runs.append({"seed": seed, "rep": rep, "scenario": scenario,
                                     "mechanism": mechanism, **kw,
                                     "error": f"torch {torch.__version__} has no reconfigure API"})
                        continue
                    with TemporaryDirectory(prefix="reform-bench-") as tmp:
                        fn = run_loss if scenario == "loss" else run_grow
                        got = fn(Path(tmp), mechanism, **kw)
                    runs.append({"seed": seed, "rep": rep, "scenario": scenario,
                                 "mechanism": mechanism, **kw, **got})
                    print(json.dumps(runs[-1]), flush=True)
    return runs


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def summarize(runs: list[dict], meta: dict) -> str:
    lines = [f"# In-place re-form: reconfigure vs destroy + init ({meta['torch']}, gloo)", "",
             f"Run: `{meta['command']}` at commit {meta['commit']}, {meta['when']}; seeds "
             f"{meta['seeds']}, {meta['reps']} repetitions each, both mechanisms in every "
             "repetition (alternating first). Medians (min-max), seconds.", ""]
    ok = [r for r in runs if "error" not in r and r.get("used") == [r["mechanism"]]]
    lines += ["## Loss (real trainer, 3 -> 2): agreed generation to the first step", "",
              "The first step's own compute is inside the figure (one step: the step time "
              "column).", "",
              "| mechanism | runs | to first step | workers' re-form | step time | "
              f"target <= {LOSS_BUDGET_S} s |", "|---|---|---|---|---|---|"]
    for m in MECHANISMS:
        cell = [r for r in ok if r["scenario"] == "loss" and r["mechanism"] == m]
        first = [r["to_first_step_s"] for r in cell]
        verdict = "-" if not first else (
            "met" if statistics.median(first) <= LOSS_BUDGET_S else "missed")
        lines.append(f"| {m} | {len(cell)} | {_stats(first)} | "
                     f"{_stats([r['reformed_s'] for r in cell])} | "
                     f"{_stats([r['step_s'] for r in cell])} | {verdict} |")
    lines += ["", "## Grow prototype (2 -> 3, a warm newcomer, state from rank 0)", "",
              "pause: the last founder's last step of the world of 2 to the last member's "
              "first step of the world of 3; beyond a step: the pause less one step time (the "
              "first step's own compute). The link is the hand-over's bytes over its time "
              "(serialisation included), so the target asks that everything but the state's "
              "transfer fit in 0.2 s.", "",
              "| mechanism | state moved | runs | pause | beyond a step | re-form | hand-over | "
              "link | target: 0.2 s + bytes/link | verdict |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for mb in sorted({r["state_mb"] for r in runs if r["scenario"] == "grow"}):
        for m in MECHANISMS:
            cell = [r for r in ok if r["scenario"] == "grow" and r["mechanism"] == m
                    and r["state_mb"] == mb]
            if not cell:
                lines.append(f"| {m} | {2 * mb:g} MB | 0 | - | - | - | - | - | - | - |")
                continue
            bw = statistics.median(r["bandwidth_Bps"] for r in cell if r["bandwidth_Bps"])
            target = JOIN_BASE_S + cell[0]["state_bytes"] / bw
            beyond = [r["pause_s"] - r["step_s"] for r in cell]
            verdict = "met" if statistics.median(beyond) <= target else "missed"
            lines.append(f"| {m} | {cell[0]['state_bytes'] / 2**20:.0f} MiB | {len(cell)} | "
                         f"{_stats([r['pause_s'] for r in cell])} | {_stats(beyond)} | "
                         f"{_stats([r['reformed_s'] for r in cell])} | "
                         f"{_stats([r['handover_s'] for r in cell])} | {bw / 1e6:.0f} MB/s | "
                         f"{target:.3f} | {verdict} |")
    errors = [r for r in runs if r not in ok]
    if errors:
        lines += ["", "## Runs without a result", ""]
        lines += [f"- seed {r['seed']} rep {r['rep']} {r['scenario']} {r['mechanism']}: "
                  f"{r.get('error') or 'ran by ' + str(r.get('used'))}" for r in errors]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--reps", type=int, default=2, help="repetitions per seed")
    p.add_argument("--state-mb", type=float, nargs="+", default=[1.0, 64.0],
                   help="model sizes of the grow prototype (the state moved is twice this)")
    p.add_argument("--out", default="benchmarks/results/reform",
                   help="writes OUT.json and OUT.md")
    p.add_argument("--summarize", metavar="JSON", help="only render JSON's runs as OUT.md")
    args = p.parse_args(argv)
    if args.summarize:
        data = json.loads(Path(args.summarize).read_text())
        Path(args.out).with_suffix(".md").write_text(summarize(data["runs"], data["meta"]))
        return 0
    started = time.time()
    runs = run_all(args.seeds, args.reps, args.state_mb)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    meta = {"torch": f"torch {torch.__version__}", "commit": commit, "seeds": args.seeds,
            "reps": args.reps, "when": time.strftime("%Y-%m-%d", time.gmtime(started)),
            "command": "python -m benchmarks.reform " + " ".join(argv or sys.argv[1:]),
            "duration_s": round(time.time() - started, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    out.with_suffix(".md").write_text(summarize(runs, meta))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
