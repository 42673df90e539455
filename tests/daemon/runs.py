"""Steps the whole-job daemon scenarios share: a world of three, one node lost, the end.

Each takes the nodes (``tests.daemon_nodes.DaemonNode``) a test's fixture started, so
the in-place scenarios and the drop-in loop's scenarios run the same choreography.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from checkpointing import CheckpointManager
from elasticd.lab.local_cluster import record_time
from tests.daemon_nodes import DaemonNode, log_lines, stepping_at, wait_for
from tests.oracle import Run, max_rel_diff, norm_rel_diff, replay, step_history

# The job the whole-job scenarios train (float64, checked against ``RUN``'s replay).
RUN = Run(samples=300, batch=4, lr=0.05, seed=7, data_seed=11, momentum=0.9)
MLP = str(Path(__file__).resolve().parents[2] / "trainer" / "examples" / "mlp.py")


def entry(final: int, script: str = MLP) -> list[str]:
    """The workers' command line: ``RUN`` to step ``final``."""
    return [script, *RUN.args(), f"--max-steps={final}", "--step-sleep=0.03", "--log-every=1",
            "--lr-rule=linear", "--lr-warmup-steps=2",
            # The LR is for the first world (3): with the daemon's default base (1) it
            # would be 3x larger and the run chaotic (rounding differences then grow
            # past the oracle's 1e-9 however exact the recovery is).
            "--lr-base-world-size=3"]


def by_rank(nodes: list[DaemonNode], rank0: bool) -> DaemonNode:
    """The node whose workers hold rank 0 (or the first that does not)."""
    return next(n for n in nodes if ((n.progress() or {}).get("rank") == 0) == rank0)


def progress_records(node: DaemonNode) -> list[dict]:
    """The workers' progress lines of ``node``, in order (every incarnation)."""
    return [r for r in node.log_events() if r.get("kind") == "progress"]


def completed(nodes: list[DaemonNode], timeout_s: float = 120) -> None:
    """Every daemon exited 0: its job completed."""
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), timeout_s,
             "every survivor's daemon to exit once the job completed", nodes)
    assert [n.proc.returncode for n in nodes] == [0] * len(nodes), [n.log_tail() for n in nodes]


def world_of_three(start: Callable[[str], DaemonNode], at_step: int = 15) -> list[DaemonNode]:
    """Nodes a, b, c in a world of 3 in its steady state: every daemon has published its
    workers' world (a fault in the first steps, before that, is recovered by the restart
    path)."""
    nodes = [start(n) for n in "abc"]
    wait_for(lambda: stepping_at(nodes, 3, 0) and all(n.progress()["step"] >= at_step
                                                       for n in nodes),
             120, f"a world of 3 at step {at_step}", nodes)
    return nodes


def lose_one(three: list[DaemonNode], everyone: list[DaemonNode], rank0: bool = False,
             sig: int = signal.SIGKILL, within_s: float = 30
             ) -> tuple[DaemonNode, list[DaemonNode], float]:
    """One node of ``three`` (the rank-0 one or another) killed or frozen; returns (that
    node, the survivors, when) once the survivors step in a world of 2."""
    victim = by_rank(three, rank0)
    survivors = [n for n in three if n is not victim]
    since = time.time()
    if sig == signal.SIGKILL:
        victim.kill()
    else:
        victim.signal_tree(sig)
    wait_for(lambda: stepping_at(survivors, 2, since), within_s, "a world of 2", everyone)
    return victim, survivors, since


def resumed_where_it_stopped(node: DaemonNode, since: float) -> dict:
    """One torchrun restart after ``since``, which resumed at the last step completed
    before it (the world of 3 may itself have formed through a restart at start-up);
    returns its ``resumed`` record."""
    progress = progress_records(node)
    (resumed,) = [r for r in progress if r["event"] == "resumed" and r["time"] > since]
    done_before = max(r["step"] for r in progress if r["time"] < resumed["time"]
                      and r["event"] in ("step", "checkpoint"))
    assert resumed["step"] == done_before, "the restart lost steps"
    return resumed


def final_matches_replay(ckpt: Path | str, history: Mapping[int, Any],
                         replayed: Callable[[], dict[str, torch.Tensor]]) -> int:
    """Every step 1..final is in ``history``, the newest checkpoint is of ``final`` and
    its model equals ``replayed()`` (the single-process replay) within 1e-9 against each
    tensor (``norm_rel_diff``, the chaos oracle's measure); ``final``.

    Not against each element: over 500 steps one weight of a rejoin run crossed zero
    (4.8e-7 at the end) and its 2.4e-15 of rounding read as 5.1e-9 of it, while the
    tensors agreed to 3.5e-14. The worst element's figure is printed beside it."""
    final = max(history)
    assert sorted(history) == list(range(1, final + 1)), "a step is missing"
    latest = CheckpointManager(ckpt, read_only=True).load_latest()
    assert latest is not None and latest.step == final
    want = replayed()
    rel = norm_rel_diff(latest.state["model"], want)
    worst = max_rel_diff(latest.state["model"], want)
    print(f"oracle: relative difference {rel:.3e} (worst element {worst:.3e}) over {final} steps")
    assert rel < 1e-9
    return final


def no_crash_counted(node: DaemonNode, since: float | None = None) -> None:
    """``node``'s daemon counted no crash: no worker restart after a crash, no agent exit
    against its budget (the sentence "... (failure 2 of 5) ..."); ``since`` (a Unix time):
    only in the lines logged after it (a scenario's fault, not its start-up's)."""
    sentences = [e["event"] for e in log_lines(node)
                 if since is None or (record_time(e) or since) >= since]
    assert not [s for s in sentences if "after a crash" in s or "(failure " in s], sentences


def matches_the_replay(node: DaemonNode, ckpt: Path | str, final: int) -> dict[int, tuple[int, float]]:
    """``node``'s per-step history, whose replay of ``RUN`` the newest checkpoint matches."""
    history = step_history(progress_records(node))
    assert final_matches_replay(ckpt, history, lambda: replay(RUN, history)) == final
    return history
