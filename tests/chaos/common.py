"""Run a chaos scenario inside a test and fail it with the report's verdict."""

from __future__ import annotations

from pathlib import Path

from elasticd.lab.chaos.invariants import Check, FaultMetrics, check_all
from elasticd.lab.chaos.report import to_markdown, write
from elasticd.lab.chaos.run import RunResult, run_scenario
from elasticd.lab.chaos.scenario import Scenario


def run_checked(sc: Scenario, tmp_path: Path, job: str) -> tuple[RunResult, list[Check], list[FaultMetrics]]:
    """Run ``sc`` (its cluster under ``tmp_path``), write the report next to it, assert
    that every invariant holds; the failure message is the report (seed, faults, checks)."""
    result = run_scenario(sc, tmp_path / "cluster", job=job)
    checks, metrics = check_all(result)
    report = write(result, checks, metrics, tmp_path / "report")
    text = to_markdown(report)
    print(text)
    failed = [c for c in checks if not c.passed]
    assert not failed, f"seed {sc.seed}: {[c.name for c in failed]} failed\n{text}"
    return result, checks, metrics
