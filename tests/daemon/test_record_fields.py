"""A real daemon publishes what in-place recovery needs in its node record: its TCP
store's endpoint (``store``, reachable) and its workers' world (``world``, from the
progress file its local rank 0 writes), and hands them the recovery settings."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from elasticd.contract.generation import WorldView
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.rendezvous.keys import JobKeys
from tests.daemon_nodes import DaemonNode, stop_nodes, wait_for

# Several real components and real waits (seconds each): in make test, not make check.
pytestmark = pytest.mark.process

# A worker that reports a generation the way the trainer does, then waits to be told to end.
_WORKER = """
import json, os, pathlib, sys, time
env = os.environ
pathlib.Path(sys.argv[1], "env.json").write_text(json.dumps({k: v for k, v in env.items()
                                                            if k.startswith("ELASTICD_")}))
record = {"event": "step", "step": 1, "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"]),
          "local_world_size": int(env["LOCAL_WORLD_SIZE"]),
          "generation": {"round": int(env["ELASTICD_GENERATION"]), "seq": 0,
                         "epoch": env.get("ELASTICD_GENERATION_EPOCH")}}
tmp = env["ELASTICD_PROGRESS_FILE"] + ".tmp"
pathlib.Path(tmp).write_text(json.dumps(record))
os.replace(tmp, env["ELASTICD_PROGRESS_FILE"])
deadline = time.monotonic() + 60
while not pathlib.Path(sys.argv[1], "done").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
"""


def test_the_record_carries_store_and_world(etcd_server, job_id, tmp_path):
    import torch.distributed as dist

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    node = DaemonNode("node-a", etcd_server.endpoint, job_id, tmp_path,
                      {"entrypoint": [str(script), str(tmp_path)], "max_nodes": 1}).start()
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,)))
    key = JobKeys(job_id).node("node-a")
    try:
        seen: dict = {}

        def record() -> bool:
            kv = client.get(key)
            seen.update(json.loads(kv.value) if kv else {})
            return "world" in seen

        wait_for(record, 60, "the node record's world", [node])
        published = seen
        world = WorldView.from_record("node-a", published["world"])
        assert (world.first_rank, world.nproc, world.world_size) == (0, 1, 1)
        assert world.generation.seq == 0 and world.generation.epoch
        host, port = published["store"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        store.set("probe", "1")
        assert store.get("probe") == b"1"
        env = json.loads((tmp_path / "env.json").read_text())
        assert env["ELASTICD_RECOVERY_MODE"] == "in-place"
        assert env["ELASTICD_GENERATION_FILE"].endswith("generation.json")
        (tmp_path / "done").touch()
        wait_for(lambda: not node.running(), 60, "the daemon to finish the job", [node])
        assert node.proc.returncode == 0, node.log_tail()
    finally:
        client.close()
        stop_nodes([node])

