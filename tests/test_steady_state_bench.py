"""benchmarks/steady_state.py's harness runs: a few pieces in-process, one variant at world 1.

Kept tiny (the default suite is at its time budget): no torchrun, no process group in
this process, ~40 steps of ElasticTrainer in one subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import steady_state
from benchmarks.steady_worker import Pieces
from elasticd.lab.embedded_etcd import free_port
from trainer.context import ElasticContext

REPO = Path(__file__).resolve().parents[1]
RESULT_KEYS = {"mode", "step_sleep_s", "world_size", "steps", "seconds", "steps_per_s",
               "step_ms_mean", "step_ms_p50", "step_ms_p90", "step_ms_max", "warmup"}


def test_pieces_measure_without_a_process_group(tmp_path: Path) -> None:
    names = ["progress_rate_limited", "step_seed", "optimizer_step", "optimizer_step_worldlr"]
    pieces = Pieces(ElasticContext.single_process(), str(tmp_path)).measure(names, 20, rounds=2)
    assert list(pieces) == names
    for piece in pieces.values():
        assert piece["us"] > 0 and len(piece["us_rounds"]) == 2 and piece["what"]
    assert (tmp_path / "progress.json").exists()  # the first step is always written
    derived = steady_state.derived(pieces)
    assert "WorldLR hooks (optimizer.step with - without)" in derived


@pytest.mark.process
def test_one_variant_at_world_one_and_the_report(tmp_path: Path) -> None:
    out = tmp_path / "trainer.json"
    env = {**steady_state.worker_env(str(tmp_path / "progress.json")), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.steady_worker", "--mode", "trainer", "--steps", "30",
         "--warmup", "5", "--step-sleep", "0.001", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result) >= RESULT_KEYS
    assert result["mode"] == "trainer" and result["steps"] == 30 and result["steps_per_s"] > 0
    assert result["step_ms_p50"] >= 1.0  # the sleep inside the step is in the clock
    assert json.loads((tmp_path / "progress.json").read_text())["event"] == "completed"

    # The report from runs shaped like the harness's: every variant, two sizes, 2 reps.
    runs = [{"rep": rep, "size": size, "variant": variant, "result": result}
            for rep in range(2) for size in ("tiny", "50ms") for variant in steady_state.VARIANTS]
    summary = steady_state.summarize(runs, "50ms")
    assert summary["cells"]["50ms"]["trainer"]["ratio"] == 1.0
    assert summary["verdicts"] == {"dropin": "met", "trainer": "met"}
    report = {"settings": {"argv": "", "reps": 2, "sleep_label": "50ms"}, "summary": summary,
              "runs": runs,
              "machine": {"cpus": os.cpu_count(), "cpu_model": "?", "torch": "?"},
              "load_start": [0.0, 0.0, 0.0], "load_end": [0.0, 0.0, 0.0]}
    text = steady_state.markdown(report)
    assert "| 50ms | trainer | bare |" in text and "trainer **met**" in text
