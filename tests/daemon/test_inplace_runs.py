"""In-place recovery end to end: real etcd, three real daemons, real torchrun, gloo, float64.

After each fault the job runs to completion and is checked against the replay oracle
(the final checkpoint equals a single-process replay of the logged per-step world sizes
and LRs within 1e-9, which also means every sample was used exactly once per epoch),
with no step lost and no torchrun restart on the in-place path; the autouse leak check
proves no process is left.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from checkpointing import CheckpointManager
from tests.daemon_nodes import DaemonNode, agent_events, log_lines, stepping_at, stop_nodes, wait_for
from tests.oracle import Run, max_rel_diff, replay, step_history

pytestmark = pytest.mark.inplace

RUN = Run(samples=300, batch=4, lr=0.05, seed=7, data_seed=11, momentum=0.9)
REPO = Path(__file__).resolve().parents[2]
FAULTY = str(REPO / "tests" / "workers" / "reform_fault.py")
MLP = str(REPO / "trainer" / "examples" / "mlp.py")


def _entry(final: int, script: str = MLP) -> list[str]:
    return [script, *RUN.args(), f"--max-steps={final}", "--step-sleep=0.03", "--log-every=1",
            "--lr-rule=linear", "--lr-warmup-steps=2",
            # The LR is for the first world (3): with the daemon's default base (1) it
            # would be 3x larger and the run chaotic (rounding differences then grow
            # past the oracle's 1e-9 however exact the recovery is).
            "--lr-base-world-size=3"]


@pytest.fixture
def job(tmp_path, job_id, etcd_server):
    nodes: list[DaemonNode] = []

    def add(name: str, final: int, script: str = MLP, mode: str = "in-place",
            min_nodes: int = 3) -> DaemonNode:
        # min_nodes 3 by default: with fewer, the first world could run the whole job
        # before the third node joined (seen); the restart-path tests need 2.
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path, {
            "entrypoint": _entry(final, script), "every_steps": 10, "min_nodes": min_nodes,
            "sections": f'[recovery]\nmode = "{mode}"\n'}).start()
        nodes.append(node)
        return node

    yield add, nodes
    stop_nodes(nodes)


def _three(add, final: int, script: str = MLP, min_nodes: int = 3) -> list[DaemonNode]:
    """A world of 3 in its steady state: every daemon has published its workers' world
    (a fault in the first steps, before that, is recovered by the restart path)."""
    nodes = [add(n, final, script, min_nodes=min_nodes) for n in "abc"]
    wait_for(lambda: stepping_at(nodes, 3, 0) and all(n.progress()["step"] >= 15 for n in nodes),
             120, "a world of 3 at step 15", nodes)
    return nodes


def _lose_one(add, nodes, final: int, rank0: bool = False, script: str = MLP,
             sig: int = signal.SIGKILL, within_s: float = 30, min_nodes: int = 3
             ) -> tuple[DaemonNode, list[DaemonNode], float]:
    """A world of 3, then one node (the rank-0 one or another) killed or frozen; returns
    (that node, the survivors, when) once the survivors step in a world of 2."""
    three = _three(add, final, script, min_nodes)
    victim = _by_rank(three, rank0)
    survivors = [n for n in three if n is not victim]
    since = time.time()
    if sig == signal.SIGKILL:
        victim.kill()
    else:
        victim.signal_tree(sig)
    wait_for(lambda: stepping_at(survivors, 2, since), within_s, "a world of 2", nodes)
    return victim, survivors, since


def _resumed_where_it_stopped(node: DaemonNode, since: float) -> None:
    """One torchrun restart after ``since``, which resumed at the last step completed
    before it (the world of 3 may itself have formed through a restart at start-up)."""
    progress = _progress(node)
    (resumed,) = [r for r in progress if r["event"] == "resumed" and r["time"] > since]
    done_before = max(r["step"] for r in progress if r["time"] < resumed["time"]
                      and r["event"] in ("step", "checkpoint"))
    assert resumed["step"] == done_before, "the restart lost steps"


def _by_rank(nodes: list[DaemonNode], rank0: bool) -> DaemonNode:
    return next(n for n in nodes if ((n.progress() or {}).get("rank") == 0) == rank0)


def _progress(node: DaemonNode) -> list[dict]:
    return [r for r in node.log_events() if r.get("kind") == "progress"]


def _completed(nodes: list[DaemonNode], timeout_s: float = 120) -> None:
    wait_for(lambda: all(n.proc.poll() is not None for n in nodes), timeout_s,
             "every survivor's daemon to exit once the job completed", nodes)
    assert [n.proc.returncode for n in nodes] == [0] * len(nodes), [n.log_tail() for n in nodes]


def _matches_the_replay(node: DaemonNode, ckpt: Path, final: int) -> dict[int, tuple[int, float]]:
    history = step_history(_progress(node))
    assert sorted(history) == list(range(1, final + 1)), "a step is missing"
    latest = CheckpointManager(ckpt, read_only=True).load_latest()
    assert latest.step == final
    rel = max_rel_diff(latest.state["model"], replay(RUN, history))
    print(f"oracle: max relative difference {rel:.3e} over {final} steps")
    assert rel < 1e-9
    return history


def _in_place(survivors: list[DaemonNode], lost: str, since: float) -> None:
    """Each survivor re-formed once, lost no step and its agent never restarted workers."""
    for node in survivors:
        reformed = agent_events(node, "reformed")
        assert len(reformed) == 1, node.log_tail()
        assert reformed[0]["lost"] == [lost]
        assert not [r for r in _progress(node) if r["event"] == "resumed" and r["time"] > since]
        sentences = [e["event"] for e in log_lines(node)]
        assert any("in place" in s for s in sentences), sentences[-20:]


@pytest.mark.parametrize("victim_rank0", [False, True], ids=["node", "rank0-node"])
def test_a_crashed_node_is_recovered_in_place(job, tmp_path, victim_rank0):
    add, nodes = job
    final = 90
    victim, survivors, crash = _lose_one(add, nodes, final, rank0=victim_rank0)
    _completed(survivors)
    _in_place(survivors, victim.name, crash)
    history = _matches_the_replay(_by_rank(survivors, True), tmp_path / "ckpt", final)
    assert {w for w, _ in history.values()} == {3, 2}


def test_a_silent_node_is_cut_loose_after_its_lease(job, tmp_path):
    add, nodes = job
    final = 110
    frozen, survivors, stopped = _lose_one(add, nodes, final, sig=signal.SIGSTOP, within_s=5 + 20)
    frozen.kill()
    _completed(survivors)
    _in_place(survivors, frozen.name, stopped)
    for node in survivors:
        assert agent_events(node, "reformed")[0]["cause"] == "released"
    _matches_the_replay(_by_rank(survivors, True), tmp_path / "ckpt", final)


def test_a_failing_re_form_falls_back_to_a_restart_and_loses_nothing(job, tmp_path):
    """Fault injected: the survivors' re-form raises; they exit, torchrun restarts them."""
    add, nodes = job
    final = 200
    _, survivors, crash = _lose_one(add, nodes, final, script=FAULTY, within_s=60, min_nodes=2)
    _completed(survivors)
    rank0 = _by_rank(survivors, True)
    failed = agent_events(rank0, "reform-failed")
    assert failed and "fault injected" in failed[0]["reason"]
    _resumed_where_it_stopped(rank0, crash)
    for node in survivors:  # one fallback event and sentence per node
        sentences = [e["event"] for e in log_lines(node)]
        assert len([s for s in sentences if "in-place re-form fell back" in s]) == 1, sentences
    _matches_the_replay(rank0, tmp_path / "ckpt", final)


def test_a_node_that_rejoins_after_an_in_place_shrink_grows_the_world_back(job, tmp_path):
    add, nodes = job
    final = 500  # long enough for the newcomer's agent to start and join (~10 s here)
    _, survivors, crash = _lose_one(add, nodes, final, min_nodes=2)
    back = time.time()
    newcomer = add("d", final, min_nodes=2)
    wait_for(lambda: stepping_at([*survivors, newcomer], 3, back), 90, "world 3 again", nodes)
    _completed([*survivors, newcomer])
    rank0 = _by_rank([*survivors, newcomer], True)
    _resumed_where_it_stopped(rank0, crash)
    history = _matches_the_replay(rank0, tmp_path / "ckpt", final)
    assert [w for _, (w, _) in sorted(history.items())][-1] == 3

