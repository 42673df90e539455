"""``elasticd chaos`` (or ``python -m elasticd.lab.chaos``): run one chaos scenario on this machine
and write its report.

    elasticd chaos --seed 7 --faults node-kill,drain      # a short one: two faults, a few minutes
    elasticd chaos --seed 7 --faults node-kill,drain,etcd-restart --out DIR
    elasticd chaos --seed 7 --overlap --out DIR   # pairs: the second inside the first's recovery
    elasticd chaos --scenario scenario.toml --out DIR
    elasticd chaos --list        # the fault kinds

``--seed`` alone draws from every default fault kind: about 15 minutes (seed 41: 14). The report
goes to ``--out`` (default ``~/elasticd-chaos/seed-N`` or ``~/elasticd-chaos/<scenario>``).

Exit status: 0 when every invariant holds, 1 when one fails, 2 for a bad scenario.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from elasticd.lab.chaos.faults import INJECTORS, default_kinds
from elasticd.lab.chaos.invariants import check_all
from elasticd.lab.chaos.report import write
from elasticd.lab.chaos.run import run_scenario
from elasticd.lab.chaos.scenario import Scenario, ScenarioError, draw, load
from elasticd.rendezvous.keys import DEFAULT_ROUNDS, ROUNDS


def parser(prog: str = "python -m elasticd.lab.chaos") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                epilog=f"a short run: {prog} --seed 7 --faults node-kill,drain "
                                "(a few minutes); --seed alone draws every default fault kind "
                                "(about 15 min)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--scenario", type=Path, help="a scenario file (.toml or .json)")
    what.add_argument("--seed", type=int, help="draw the scenario from this seed (with --faults)")
    what.add_argument("--list", action="store_true", help="list the fault kinds and exit")
    p.add_argument("--faults", default=",".join(default_kinds()),
                   help="comma-separated fault kinds to draw from (default: all but "
                   "checkpoint-dir-full, which needs the checkpoint directory on a small tmpfs, "
                   "and the network faults, which need root and iptables and run in a "
                   "scenario of their own: name them here)")
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--rounds", choices=ROUNDS, default=DEFAULT_ROUNDS,
                   help="the daemons' rendezvous layout ([rendezvous] rounds)")
    p.add_argument("--overlap", action="store_true",
                   help="draw the faults in pairs, the second fired 0-2 s into a drawn phase of "
                   "the first one's recovery (a drain's stop, a restart, a round, a re-form, a join)")
    p.add_argument("--spacing", type=int, default=60, help="steps between drawn faults")
    p.add_argument("--final-step", type=int, default=None,
                   help="the job's last step for a drawn scenario (default: 150 past the last fault; "
                   "a fault fires only once the previous one recovered, so give room)")
    p.add_argument("--out", type=Path, default=None,
                   help="where the report goes (default: ~/elasticd-chaos/seed-N, or the scenario "
                   "file's name)")
    p.add_argument("--keep", action="store_true", help="keep the cluster's logs and checkpoints "
                   "(in OUT/cluster)")
    return p


def scenario_of(args: argparse.Namespace) -> Scenario:
    if args.scenario is not None:
        return load(args.scenario)
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    extra: dict[str, object] = {"rounds": args.rounds}
    if args.final_step is not None:
        extra["final_step"] = args.final_step
    return draw(args.seed, kinds, nodes=args.nodes, spacing=args.spacing, overlap=args.overlap,
                **extra)


def _exit_on(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)   # unwinds through local_cluster: every process is killed


def default_out(args: argparse.Namespace) -> Path:
    """Not the current directory (a report dropped wherever the command ran): one folder
    per seed or scenario under ~/elasticd-chaos, as the demo writes to ~/elasticd-demo."""
    name = f"seed-{args.seed}" if args.seed is not None else Path(args.scenario).stem
    return Path.home() / "elasticd-chaos" / name


def main(argv: list[str] | None = None, prog: str = "python -m elasticd.lab.chaos") -> int:
    args = parser(prog).parse_args(argv)
    if args.list:
        for name, cls in INJECTORS.items():
            print(f"{name:24} {cls.summary}")
        return 0
    try:
        sc = scenario_of(args)
    except ScenarioError as exc:
        print(f"bad scenario: {exc}", file=sys.stderr)
        return 2
    args.out = args.out if args.out is not None else default_out(args)
    root = args.out / "cluster" if args.keep else Path(tempfile.mkdtemp(prefix="elasticd-chaos-"))
    # A background job of a non-interactive shell starts with SIGINT ignored (seen: the
    # run could not be interrupted); SIGTERM would kill it without its cleanup.
    previous = {sig: signal.signal(sig, _exit_on) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        result = run_scenario(sc, root)
        checks, metrics = check_all(result)
        report = write(result, checks, metrics, args.out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    for c in checks:
        print(f"{'pass' if c.passed else 'FAIL'}  {c.name}: {c.detail}")
    print(f"report: {args.out}/chaos.md, chaos.json, chaos.png; replay: {report['replay']}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
