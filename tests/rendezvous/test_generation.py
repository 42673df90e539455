"""The etcd3 handler exports the world's generation (ELASTICD_GENERATION and its epoch) to
the workers torchrun starts: real torchrun agents, real etcd, real gloo workers."""

from __future__ import annotations

import json
import os
import signal

import pytest

from elasticd.contract.settings import contract_env_names
from elasticd.rendezvous.handler import GENERATION_ENV, GENERATION_EPOCH_ENV
from tests.torchrun_nodes import WORKER, TorchrunNode, latest, stop_all, wait_until, world_after

# The allreduce worker, after recording the generation its environment carries.
_PROBE = f"""
import json, os, runpy
with open(os.path.join(os.environ["REPORT_DIR"], "generations.jsonl"), "a") as fh:
    fh.write(json.dumps({{"node": os.environ["NODE_NAME"], "pid": os.getpid(),
                         "generation": os.environ.get("{GENERATION_ENV}"),
                         "epoch": os.environ.get("{GENERATION_EPOCH_ENV}"),
                         "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}}) + "\\n")
runpy.run_path({WORKER!r}, run_name="__main__")
"""


def _generations(report_dir) -> list[dict]:
    path = report_dir / "generations.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def test_the_variables_are_the_worker_contracts():
    assert {GENERATION_ENV, GENERATION_EPOCH_ENV} <= set(contract_env_names())


@pytest.fixture
def cluster(tmp_path, job_id):
    nodes: list[TorchrunNode] = []
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)

    def add(name: str, endpoint: str, **kw) -> TorchrunNode:
        node = TorchrunNode(name, endpoint, job_id, tmp_path, script_path=str(probe), **kw).start()
        nodes.append(node)
        return node

    yield add, nodes
    for node in nodes:
        node.kill()


@pytest.mark.process
def test_workers_see_their_generation_and_a_restart_raises_it(etcd_server, cluster, tmp_path):
    add, nodes = cluster
    for name in "ab":
        add(name, etcd_server.endpoint, nnodes="2", step_sleep=0.05)
    wait_until(lambda: world_after(tmp_path, ["a", "b"], 2, 0), 90, "world of 2", nodes)
    first = _generations(tmp_path)
    assert len(first) == 2, first
    # torch keeps `round` at the completed round's number: the first world is round 0.
    assert {r["generation"] for r in first} == {"0"}, first
    epochs = {r["epoch"] for r in first}
    assert len(epochs) == 1 and None not in epochs, first

    seen = [0]
    seen_pids = {r["pid"] for r in first}
    for restart in (1, 2):
        old = {n.name: latest(tmp_path, n.name)["pid"] for n in nodes}
        os.kill(old["a"], signal.SIGKILL)
        wait_until(lambda old=old: all((rec := latest(tmp_path, n)) and rec["pid"] != old[n]
                                       and rec["world"] == 2 for n in old),
                   60, f"forced restart {restart}", nodes)
        new = [r for r in _generations(tmp_path) if r["pid"] not in seen_pids]
        seen_pids |= {r["pid"] for r in new}
        assert len(new) == 2, _generations(tmp_path)
        values = {int(r["generation"]) for r in new}
        assert len(values) == 1, new          # one world, one generation
        assert values.pop() > seen[-1], (seen, new)   # a newer world, a larger generation
        seen.append(int(new[0]["generation"]))
        assert {r["epoch"] for r in new} == epochs  # the same rendezvous state
    assert stop_all(nodes, tmp_path) == [0, 0]
