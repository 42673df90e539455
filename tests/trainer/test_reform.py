"""The two re-form mechanisms (trainer.reform) on real processes, gloo, real TCP stores.

Three founding members form torchrun's world on a store that rank 0 hosts (as torchrun's
rank 0 does); rank 0's process is then SIGKILLed, so its store dies with it: the survivors
must re-form through the next generation's store (hosted here, standing in for a
survivor's daemon); then a brand-new process grows the group back. Each mechanism the
installed torch has is run: ``destroy-init`` everywhere, ``reconfigure`` where torch has
the API (2.14+; ``auto`` must choose it there, and must choose destroy + init on 2.13).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticd import proctree
from elasticd.contract.generation import GenerationId, GenerationRecord, renumber
from elasticd.lab.embedded_etcd import free_port
from elasticd.rendezvous import torch_compat
from trainer import reform

REPO = Path(__file__).resolve().parents[2]
MEMBER = REPO / "tests" / "workers" / "reform_member.py"
MECHANISMS = [pytest.param(reform.DESTROY_INIT, id="destroy-init"),
              pytest.param("auto", id="auto")]


class Group:
    def __init__(self, folder: Path, mechanism: str) -> None:
        self.folder, self.mechanism = folder, mechanism
        self.procs: dict[str, subprocess.Popen] = {}
        self.world = f"127.0.0.1:{free_port()}"
        self.stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
                       for _ in range(2)]

    def start(self, node: str, *world: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        with open(self.folder / f"{node}.log", "wb") as log:
            self.procs[node] = subprocess.Popen(
                [sys.executable, str(MEMBER), node, str(self.folder), self.mechanism, *world],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def results(self, node: str) -> dict:
        path = self.folder / f"{node}.json"
        return json.loads(path.read_text()) if path.exists() else {"results": []}

    def wait_for(self, nodes: list[str], count: int) -> None:
        ok = proctree.wait_for(lambda: all(len(self.results(n)["results"]) >= count
                                           for n in nodes), 60)
        assert ok, self.tails()

    def publish(self, i: int, nodes: list[str], store: dist.TCPStore) -> GenerationRecord:
        record = GenerationRecord(GenerationId(0, i, "t"), renumber((n, 1) for n in nodes),
                                  store=f"127.0.0.1:{store.port}")
        tmp = self.folder / "gen.tmp"
        tmp.write_text(record.to_json())
        os.replace(tmp, self.folder / f"gen{i}.json")
        return record

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{(self.folder / f'{n}.log').read_text()[-2500:]}"
                         for n in self.procs)

    def close(self) -> None:
        (self.folder / "done").touch()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proctree.kill_tree(proc.pid)
                    proc.wait()


@pytest.fixture
def group(tmp_path):
    made: list[Group] = []

    def make(mechanism: str) -> Group:
        made.append(Group(tmp_path, mechanism))
        return made[-1]

    yield make
    for g in made:
        g.close()


@pytest.mark.process
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_the_store_host_is_lost_then_a_newcomer_grows_the_group(group, mechanism):
    g = group(mechanism)
    for rank in range(3):
        g.start(f"n{rank}", g.world, str(rank), "3")
    g.wait_for(["n0", "n1", "n2"], 1)
    os.killpg(g.procs["n0"].pid, signal.SIGKILL)  # rank 0, and the world's store with it
    g.procs["n0"].wait()
    g.publish(1, ["n1", "n2"], g.stores[0])
    g.wait_for(["n1", "n2"], 2)
    g.start("n3")  # a brand-new process
    time.sleep(0.5)
    g.publish(2, ["n1", "n2", "n3"], g.stores[1])
    g.wait_for(["n1", "n2"], 3)
    g.wait_for(["n3"], 1)

    expected = reform.planned_mechanism("gloo") if mechanism == "auto" else mechanism
    by_node = {n: g.results(n) for n in ("n1", "n2", "n3")}
    assert {r["mechanism"] for r in by_node.values()} == {expected}
    survivors = [(r["generation"], r["rank"], r["world_size"], r["sum"])
                 for r in by_node["n2"]["results"]]
    assert survivors == [("0.0", 2, 3, 6.0), ("0.1", 1, 2, 3.0), ("0.2", 1, 3, 6.0)]
    assert [(r["generation"], r["rank"], r["sum"]) for r in by_node["n3"]["results"]] == [
        ("0.2", 2, 6.0)]


def test_auto_chooses_by_what_torch_has():
    """reconfigure exactly where torch has the API; destroy + init on torch 2.13."""
    has_api = all(hasattr(dist, n) for n in ("_reconfigure", "_get_reconfigure_handle"))
    assert torch_compat.reconfigure_api() == has_api
    assert reform.planned_mechanism("gloo") == (reform.RECONFIGURE if has_api
                                                else reform.DESTROY_INIT)


def test_generation_uuids_grow_with_the_generation():
    ids = [GenerationId(0, 0), GenerationId(0, 1), GenerationId(0, 2), GenerationId(1, 0),
           GenerationId(1, 5), GenerationId(7, 3)]
    uuids = [reform.generation_uuid(g) for g in ids]
    assert uuids == sorted(uuids) and len(set(uuids)) == len(uuids)


def test_the_generation_store_forwards_to_its_current_target():
    first = dist.HashStore()
    second = dist.HashStore()
    store = reform.GenerationStore(first)
    prefixed = dist.PrefixStore("p", store)  # as torch wraps the store a group is made on
    prefixed.set("a", b"1")
    assert first.get("p/a") == b"1" and prefixed.add("n", 2) == 2
    assert prefixed.compare_set("a", b"1", b"2") == b"2" and prefixed.check(["a"])
    store.follow(second)
    assert not prefixed.check(["a"])
    prefixed.set("b", b"x")
    prefixed.wait(["b"])
    assert second.get("p/b") == b"x" and prefixed.get("b") == b"x"
    assert prefixed.delete_key("b") and store.num_keys() == second.num_keys()
