"""Issue 27's attacks, as a writer of the job's etcd prefix would make them, against a
running job: real etcd, real daemons, real torchrun and gloo workers.

Each must fail to steer the job: no foreign member, no node failed, no worker restarted
for it, training goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticd import proctree
from elasticd.contract.generation import GenerationId, GenerationRecord, renumber
from elasticd.rendezvous import admin
from elasticd.rendezvous.keys import JobKeys
from tests.daemon.runs import by_rank, completed, entry, matches_the_replay, progress_records, world_of_three
from tests.daemon_nodes import DaemonNode, log_lines, nodes_and_client, stepping_at, wait_for
from trainer.inplace import ARRIVED_KEY


@pytest.fixture
def cluster(etcd_server):
    with nodes_and_client(etcd_server.endpoint) as made:
        yield made


def _start(nodes: list[DaemonNode], names: str, etcd_server, job_id: str, tmp_path,
           **config) -> list[DaemonNode]:
    started = [DaemonNode(name, etcd_server.endpoint, job_id, tmp_path,
                          {"min_nodes": 1, "max_nodes": 3, **config}).start() for name in names]
    nodes.extend(started)
    return started


def _worker_pids(nodes: list[DaemonNode]) -> set[int]:
    return {p.pid for node in nodes for p in node.workers()}


@pytest.mark.slow
def test_stray_join_keys_neither_restart_the_workers_nor_stop_the_next_round(
        tmp_path, job_id, etcd_server, cluster):
    # Finding 2: one key under rdzv/join/<next round>/ made both agents stop for a
    # "waiting node"; the stray key was the next round's leader; it never closed and every
    # daemon was FAILED 5 join timeouts later. The restart path, where every membership
    # change goes through a rendezvous round.
    nodes, client = cluster
    keys = JobKeys(job_id)
    a, b = _start(nodes, "ab", etcd_server, job_id, tmp_path, recovery="restart")
    wait_for(lambda: stepping_at(nodes, 2, 0), 120, "world of 2", nodes)
    round_ = admin.current_round(client, keys).round
    workers = _worker_pids(nodes)
    assert len(workers) == 2
    lease = client.grant_lease(300)
    following = keys.rdzv_joins(round_ + 1)
    client.put(following + "stray", b"{}")                                   # on no lease
    client.put(following + "10.9.9.8_2_0", b'["10.9.9.8", 2, 0]', lease)     # no liveness key
    put_at = time.time()
    wait_for(lambda: client.get(following + "stray") is None, 30, "the stray key removed", nodes)
    wait_for(lambda: stepping_at(nodes, 2, put_at + 8), 60, "steps 8 s after the puts", nodes)
    assert admin.current_round(client, keys).round == round_
    assert _worker_pids(nodes) == workers, "a stray key restarted the workers"

    # The forged join is now the oldest key of the next round: a real join still forms it.
    joined_at = time.time()
    _start(nodes, "c", etcd_server, job_id, tmp_path, recovery="restart")
    wait_for(lambda: stepping_at(nodes, 3, joined_at), 120, "world of 3 with the newcomer", nodes)
    assert admin.current_round(client, keys).round == round_ + 1
    for node in nodes:
        assert node.running(), node.log_tail()
        assert not [e for e in log_lines(node) if "failed" in e.get("event", "")], node.log_tail()


@pytest.mark.slow
def test_a_corrupt_round_pointer_and_world_fail_no_node(tmp_path, job_id, etcd_server, cluster):
    # Finding 3: the daemons tolerated a malformed rdzv/round, the agents raised
    # CorruptRoundError at their next rendezvous and every daemon was FAILED within 25 s.
    nodes, client = cluster
    keys = JobKeys(job_id)
    _start(nodes, "ab", etcd_server, job_id, tmp_path, recovery="restart")
    wait_for(lambda: stepping_at(nodes, 2, 0), 120, "world of 2", nodes)
    round_ = admin.current_round(client, keys).round
    client.put(keys.rdzv_round, b"\x80not a pointer")
    client.put(keys.rdzv_world(round_), b'{"round": "x"}')
    joined_at = time.time()
    _start(nodes, "c", etcd_server, job_id, tmp_path, recovery="restart")   # a next rendezvous
    wait_for(lambda: stepping_at(nodes, 3, joined_at), 120, "world of 3 over the corrupt records",
             nodes)
    view = admin.current_round(client, keys)        # repaired: a good pointer above them
    assert view.round > round_ and view.world_nodes == 3
    for node in nodes:
        assert node.running(), node.log_tail()
        assert not [e for e in log_lines(node) if "failed" in e.get("event", "")], node.log_tail()


@pytest.mark.slow
def test_a_forged_generation_record_puts_no_foreign_member_in_the_group(
        tmp_path, job_id, etcd_server, cluster):
    # Finding 1: one put of a record naming [b, mallory], lost=[a], with a store the
    # attacker hosted: a's daemon fenced its workers out, b's re-formed through the
    # attacker's store, the attacker joined as rank 1 and handed b its weights, and rank
    # 0 committed them as a verified checkpoint.
    nodes, client = cluster
    keys = JobKeys(job_id)
    a, b = _start(nodes, "ab", etcd_server, job_id, tmp_path)
    wait_for(lambda: stepping_at(nodes, 2, 0), 120, "world of 2", nodes)
    workers = _worker_pids(nodes)
    live = GenerationId.from_dict(b.progress()["generation"])
    trap = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    forged = GenerationRecord(live.next(), renumber([("b", 1), ("mallory", 1)]),
                              f"127.0.0.1:{trap.port}", lost=("a",), cause="peer-crashed")
    client.put(keys.generation, forged.to_json().encode())
    put_at = time.time()
    wait_for(lambda: stepping_at(nodes, 2, put_at + 5), 60, "steps 5 s after the put", nodes)
    assert _worker_pids(nodes) == workers, "the forged record fenced or restarted a worker"
    assert all(_refused(n) for n in nodes), "a daemon did not say it refused the record"
    assert not trap.check([forged.store_prefix + ARRIVED_KEY]), "a worker came to the trap"
    assert "mallory" in _refused(b)[0]["problem"]

    # The job still recovers from a real loss (the refused record is not built on: the
    # restart path), and no checkpoint holds anything but the job's own training.
    crashed = time.time()
    a.kill()
    wait_for(lambda: stepping_at([b], 1, crashed), 90, "b stepping alone after a's crash", nodes)
    assert b.running(), b.log_tail()
    assert not trap.check([forged.store_prefix + ARRIVED_KEY])


def _refused(node: DaemonNode) -> list[dict]:
    return [e for e in log_lines(node) if e.get("event", "").startswith(
        "not handing our workers an agreed generation")]


INTRUDER = str(Path(__file__).resolve().parents[1] / "workers" / "store_intruder.py")


@pytest.mark.slow
def test_a_host_that_reaches_the_store_puts_nothing_of_its_own_into_the_job(
        tmp_path, job_id, etcd_server, cluster):
    # Finding 4: the recovery store is open to whoever reaches its port, and the next
    # generation's prefix is predictable. An intruder joins the group the survivors of a
    # loss will form, as the rank the other survivor is to take, before any of them comes.
    # With the job's secret (every lab cluster has one) it cannot prove itself: whatever
    # gloo lets it do, the re-form ends (the restart path) before any state moves, the job
    # completes and its final checkpoint is the replay's: nothing of the intruder's in it.
    nodes, client = cluster
    final = 120
    keys = JobKeys(job_id)

    def start(name: str) -> DaemonNode:
        node = DaemonNode(name, etcd_server.endpoint, job_id, tmp_path, {
            # min_nodes 2: where the proof ends the re-form, the restart path's round must
            # be able to form with the two survivors.
            "entrypoint": entry(final), "every_steps": 10, "min_nodes": 2}).start()
        nodes.append(node)
        return node

    three = world_of_three(start)
    holder = by_rank(three, True)
    victim = next(n for n in three if n is not holder)
    survivors = [n for n in three if n is not victim]
    coming = GenerationId.from_dict(holder.progress()["generation"]).next()
    store = json.loads(client.get(keys.node(holder.name)).value)["store"]
    report = tmp_path / "intruder.json"
    intruder = subprocess.Popen([sys.executable, INTRUDER, store, coming.store_prefix, "1", "2",
                                 str(report)], start_new_session=True)
    try:
        wait_for(lambda: report.exists(), 60, "the intruder at the store", nodes)
        crash = time.time()
        victim.kill()
        wait_for(lambda: stepping_at(survivors, 2, crash), 90, "a world of 2 after the loss", nodes)
        completed(survivors)
    finally:
        proctree.kill_tree(intruder.pid)
        intruder.wait()
    seen = json.loads(report.read_text())
    print("intruder:", seen)
    assert seen["arrived"] >= 1   # it reached the store and counted itself in
    matches_the_replay(holder if holder in survivors else by_rank(survivors, True),
                       tmp_path / "ckpt", final)
    failed = [(n.name, r["reason"]) for n in survivors for r in progress_records(n)
              if r["event"] == "reform-failed"]
    print("re-forms that failed:", failed)
    refused = [f for f in failed if "did not prove the job's secret" in f[1]]
    # Seen: the members formed first and the intruder waited at the store; or its gloo
    # init completed beside theirs and its first collective was reset while the members'
    # group re-formed without it. Where it shares a collective with them, the proof is
    # what keeps it out.
    if seen.get("gathered"):
        assert refused, "the intruder took part in the group's collective and nobody refused it"
