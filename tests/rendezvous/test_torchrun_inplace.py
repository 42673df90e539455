"""In-place recovery under plain torchrun (``--rdzv-conf recovery=in-place``, no daemon):
real etcd, three real torchrun agents with the etcd3 plugin, the trainer's MLP on gloo
in float64.

One node's whole process tree is SIGKILLed (another node, or the rank-0 one): the
survivors' agents' companions agree the next generation and the survivors re-form in
place (one ``reformed`` record each, no worker restart); the job completes, its final
checkpoint equals the single-process replay within 1e-9 (so every sample was used once
per epoch) and no step is lost; the autouse leak check proves no process is left.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.daemon.runs import by_rank, completed, final_matches_replay, lose_one, progress_records
from tests.oracle import Run, replay, step_history
from tests.torchrun_nodes import FAST_RDZV_CONF, TorchrunNode, wait_until
from trainer import reform

pytestmark = pytest.mark.inplace

RUN = Run(samples=300, batch=4, lr=0.05, seed=7, data_seed=11, momentum=0.9)
MLP = str(Path(__file__).resolve().parents[2] / "trainer" / "examples" / "mlp.py")
FINAL = 90


def _args(final: int) -> tuple[str, ...]:
    # As tests/daemon/test_inplace_runs.py: the LR is for the first world (3).
    return (*RUN.args(), f"--max-steps={final}", "--step-sleep=0.03", "--log-every=1",
            "--lr-rule=linear", "--lr-warmup-steps=2", "--lr-base-world-size=3")


@pytest.fixture
def agents(tmp_path, job_id, etcd_server):
    nodes: list[TorchrunNode] = []

    def add(name: str, rounds: str, recovery: str = "in-place") -> TorchrunNode:
        # nnodes 3:3: a first world of two could run the whole job before the third joined.
        node = TorchrunNode(name, etcd_server.endpoint, job_id, tmp_path, nnodes="3:3",
                            rdzv_conf=f"{FAST_RDZV_CONF},rounds={rounds},recovery={recovery}",
                            script_path=MLP, script_args=_args(FINAL), every_steps=10).start()
        nodes.append(node)
        return node

    yield add, nodes
    for node in nodes:
        node.kill()


def _world_of_three(add, rounds: str) -> list[TorchrunNode]:
    nodes = [add(n, rounds) for n in "abc"]
    wait_until(lambda: all((p := n.progress()) and p.get("world_size") == 3 and p["step"] >= 15
                           for n in nodes), 120, "a world of 3 at step 15", nodes)
    return nodes


def _reformed_in_place(survivors: list[TorchrunNode], victim: TorchrunNode, since: float
                       ) -> list[float]:
    """Each survivor re-formed once without the victim's agent, and no worker restarted;
    the re-forms' durations."""
    lost = f"127.0.0.1_{victim.proc.pid}_0"
    took = []
    for node in survivors:
        records = progress_records(node)
        reformed = [r for r in records if r["event"] == "reformed"]
        assert len(reformed) == 1, node.log_tail()
        assert reformed[0]["lost"] == [lost]
        assert reformed[0]["mechanism"] == reform.planned_mechanism("gloo", reformed[0]["stuck"])
        assert not [r for r in records if r["event"] == "resumed" and r["time"] > since], \
            "a survivor's workers were restarted"
        # The agent's one sentence (its log is torchrun's console output, not JSON lines).
        sentences = [line for line in node.log_path.read_text().splitlines()
                     if f"] lost {lost} (peer-crashed): generation" in line]
        assert len(sentences) == 1, node.log_tail()
        took.append(reformed[0]["duration_s"])
    return took


@pytest.mark.parametrize("rounds", ["torch", pytest.param("keyed", marks=pytest.mark.compat)])
@pytest.mark.parametrize("victim_rank0", [False, True], ids=["node", "rank0-node"])
def test_plain_torchrun_survivors_re_form_in_place(agents, tmp_path, rounds, victim_rank0):
    add, nodes = agents
    started = time.monotonic()
    three = _world_of_three(add, rounds)
    victim, survivors, crash = lose_one(three, nodes, rank0=victim_rank0, within_s=30)
    completed(survivors)
    took = _reformed_in_place(survivors, victim, crash)
    rank0 = by_rank(survivors, True)
    history = step_history(progress_records(rank0))
    assert final_matches_replay(tmp_path / "ckpt", history, lambda: replay(RUN, history)) == FINAL
    assert {w for w, _ in history.values()} == {3, 2}
    print(f"re-formed in place in {', '.join(f'{t:.3f}' for t in took)} s; "
          f"test took {time.monotonic() - started:.1f} s")
