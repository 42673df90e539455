"""`elasticd timeline`: a job's history from its etcd journal, as JSON and as a PNG.

The real test runs a 3-node job (real daemons, torchrun, gloo workers, min_nodes 2),
SIGKILLs a node that does not hold rank 0, starts it again, and reads the timeline
with the CLI of a survivor's config while the job runs. The others feed a real etcd
entries written by hand: malformed ones are skipped with one warning each.
"""

from __future__ import annotations

import contextlib
import json
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from elasticd.cli import main
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.journal import recent_events
from elasticd.lab.local_cluster import DaemonNode, local_cluster, stepping_at, wait_for
from elasticd.ops.timeline import Entry, build_timeline
from elasticd.rendezvous.keys import JobKeys

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _timeline(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticd", "timeline", "--config", str(config),
                           *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def crash_and_rejoin(etcd_server, tmp_path_factory):
    """The job, its crash and the rejoin; the CLI's outputs. Every process is gone after."""
    root = tmp_path_factory.mktemp("timeline")
    job = f"timeline-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    took: dict[str, float] = {}

    def lap(what: str) -> None:
        took[what] = round(time.monotonic() - started - sum(took.values()), 1)

    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,), retry_s=3))
    with contextlib.closing(client), local_cluster(root / "cluster", etcd=False) as cluster:
        nodes = [cluster.add(DaemonNode(name, etcd_server.endpoint, job, cluster.root,
                                        {"min_nodes": 2}))
                 for name in ("node-a", "node-b", "node-c")]
        wait_for(lambda: stepping_at(nodes, 3, 0), 120, "a world of 3", nodes)
        lap("world of 3")
        victim = next(n for n in nodes if (n.progress() or {}).get("rank") != 0)
        survivors = [n for n in nodes if n is not victim]
        crash = time.time()
        victim.kill()
        wait_for(lambda: stepping_at(survivors, 2, crash), 90, "the survivors at world size 2",
                 nodes)
        lap("crash to world of 2")

        def rejoined() -> bool:
            mine = [e for e in recent_events(client, JobKeys(job), limit=10_000)
                    if e["node"] == victim.name]
            return [e["kind"] for e in mine].count("agent-started") >= 2

        victim.start()
        wait_for(rejoined, 60, f"{victim.name} registered and its agent started again", nodes)
        lap("restart to agent started")
        config = survivors[0].config_path
        png = root / "x.png"
        drawn = _timeline(config, "--out", str(png))
        as_json = _timeline(config, "--json")
        lap("two timeline commands")
    print(f"timeline scenario: {took} ({png})")
    return {"victim": victim.name, "survivors": [n.name for n in survivors], "crash": crash,
            "drawn": drawn, "json": as_json, "png": png}


@pytest.mark.slow
def test_timeline_json_shows_the_crash_and_the_rejoin(crash_and_rejoin):
    run = crash_and_rejoin
    assert run["json"].returncode == 0, run["json"].stderr
    tl = json.loads(run["json"].stdout)
    victim, survivors = run["victim"], run["survivors"]
    assert set(tl["nodes"]) == {victim, *survivors}
    lost = [f for f in tl["faults"] if f["kind"] == "peer-lost" and f["node"] == victim]
    assert len(lost) == 1, tl["faults"]
    assert lost[0]["how"] == "crashed"
    assert len(lost[0]["reported_by"]) == 1 and lost[0]["reported_by"][0] in survivors
    assert lost[0]["time"] >= run["crash"]
    first, second = tl["nodes"][victim]["member"]
    assert first["end_kind"] == "lost (crashed)" and first["end"] == lost[0]["t"]
    assert second["start_kind"] == "node-joined" and second["start"] > first["end"]
    assert second["end"] is None                      # up when the timeline was read
    assert len(tl["nodes"][victim]["running"]) == 2
    for name in survivors:
        [member] = tl["nodes"][name]["member"]
        assert member["end"] is None and member["start"] < lost[0]["t"]
    assert any(s["node"] in survivors and s["step"] > 0 for s in tl["steps"])
    assert tl["warnings"] == []


@pytest.mark.process
def test_timeline_json_shows_the_recovery(crash_and_rejoin):
    tl = json.loads(crash_and_rejoin["json"].stdout)
    # In place (the default) or, for a crash before every daemon published its world,
    # by a restart: either way one recovery, journaled once (by the new world's rank 0).
    recoveries = [r for r in tl["recoveries"] if r["kind"] in ("peer-crashed",
                                                                "peer-crashed in place")]
    assert len(recoveries) == 1, tl["recoveries"]
    assert recoveries[0]["node"] in crash_and_rejoin["survivors"]
    assert recoveries[0]["duration_s"] > 0


@pytest.mark.process
def test_timeline_png_is_drawn(crash_and_rejoin):
    run = crash_and_rejoin
    assert run["drawn"].returncode == 0, run["drawn"].stderr
    data = run["png"].read_bytes()
    assert data[:8] == PNG_MAGIC
    width, height = struct.unpack(">II", data[16:24])   # the IHDR chunk comes first
    assert width >= 1000 and height >= 600, (width, height)
    assert "Traceback" not in run["drawn"].stderr


# -- entries written by hand ---------------------------------------------------------------

@pytest.fixture
def journal(etcd_server, tmp_path):
    job = f"timeline-{uuid.uuid4().hex[:8]}"
    keys = JobKeys(job)
    client = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,), retry_s=3))
    config = tmp_path / "node.toml"
    config.write_text(f'[job]\nid = "{job}"\nentrypoint = ["train.py"]\n\n'
                      f'[etcd]\nendpoints = ["{etcd_server.endpoint}"]\n')
    t0 = 1_700_000_000.0

    def put(node: str, kind: str | None, dt: float, raw: bytes | None = None, **fields) -> None:
        t = t0 + dt
        value = raw if raw is not None else json.dumps(
            {"kind": kind, "node": node, "time": t, **fields}).encode()
        client.put(f"{keys.events}{int(t * 1e9):020d}-{node}", value)

    yield put, config, keys
    for kv in client.get_prefix(keys.prefix):
        client.delete(kv.key)
    client.close()


def test_malformed_entries_are_skipped_with_one_warning_each(journal, tmp_path):
    put, config, keys = journal
    put("a", "node-joined", 0)
    put("a", "agent-started", 0.1)
    put("b", "node-joined", 0.2)
    put("a", "peer-lost", 5, step=10, world_size=2, round=1, peer="b", how="crashed")
    put("a", "recovered", 9, step=11, world_size=1, round=2, fault="peer-crashed", duration_s=4.0)
    put("a", None, 1, raw=b"\xff not json")                       # not JSON
    put("a", None, 2, raw=b"[1, 2]")                              # not an object
    put("a", "peer-lost", 3, peer=7, how="crashed")              # peer not a node id
    put("a", "recovered", 4, duration_s="fast")                  # duration not a number
    put("a", "workers-restarted", 6, step=True, cause="crash")   # a bool is not a step
    put("b", None, 7, raw=json.dumps({"kind": "node-left", "node": "a", "time": 1.0}).encode())
    put("a", "node-joined", 8, raw=json.dumps({"kind": "node-joined", "node": "a",
                                               "time": float("inf")}).encode())
    result = CliRunner().invoke(main, ["timeline", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    tl = json.loads(result.stdout)
    assert len(tl["warnings"]) == 7, tl["warnings"]
    assert all(w.startswith(keys.events) for w in tl["warnings"])
    assert tl["entries"] == 5
    assert [f["node"] for f in tl["faults"]] == ["b"]
    assert tl["recoveries"] == [{"node": "a", "kind": "peer-crashed", "duration_s": 4.0, "t": 9.0,
                                 "fault_t": 5.0, "time": 1_700_000_009.0, "step": 11}]
    assert tl["nodes"]["b"]["member"][0]["end_kind"] == "lost (crashed)"
    png = tmp_path / "x.png"
    drawn = CliRunner().invoke(main, ["timeline", "--config", str(config), "--out", str(png)])
    assert drawn.exit_code == 0, drawn.output
    assert drawn.output.count("warning:") == 7
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_an_empty_journal_is_an_error_not_a_traceback(journal):
    _, config, _ = journal
    result = CliRunner().invoke(main, ["timeline", "--config", str(config), "--json"])
    assert result.exit_code == 1
    assert "has no valid entry" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def _entry(node: str, kind: str, t: float, **fields) -> Entry:
    return Entry(f"/elasticd/j/events/{int(t * 1e9):020d}-{node}", kind, node, t, fields)


def test_survivors_reports_are_one_fault_and_a_silent_node_that_returns_opens_an_interval():
    entries = [_entry("a", "node-joined", 100), _entry("b", "node-joined", 100.5),
               _entry("c", "node-joined", 101),
               _entry("a", "peer-lost", 110, peer="c", how="silent", step=50),
               _entry("b", "peer-lost", 110.2, peer="c", how="silent", step=50),
               # c was only frozen: it restarts its workers and is back
               _entry("c", "workers-restarted", 130, cause="membership", step=60),
               _entry("b", "node-draining", 140, reason="drain", grace_s=30.0),
               _entry("b", "node-left", 145, step=80),
               _entry("a", "peer-lost", 145.1, peer="b", how="left", step=80),
               _entry("a", "job-completed", 150, step=100)]
    tl = build_timeline(entries, "j", as_of=999)
    assert [(f["node"], f["how"], f["reported_by"]) for f in tl["faults"]] == [
        ("c", "silent", ["a", "b"]), ("b", "left", ["a"])]
    assert [(i["start"], i["end"], i["end_kind"]) for i in tl["nodes"]["c"]["member"]] == [
        (1.0, 10.0, "lost (silent)"), (30.0, None, None)]
    assert [(i["end"], i["end_kind"]) for i in tl["nodes"]["b"]["member"]] == [(45.0, "left")]
    assert tl["nodes"]["a"]["member"][0]["end_kind"] == "completed"
    assert tl["completed"] and tl["duration_s"] == 50.0      # a completed job ends there
    assert [s["step"] for s in tl["steps"]] == [50, 50, 60, 80, 80, 100]


def test_an_in_place_recovery_is_a_recovery_of_its_daemon_s():
    entries = [_entry("a", "node-joined", 100), _entry("b", "node-joined", 100.5),
               _entry("a", "peer-lost", 110, peer="b", how="crashed", step=50),
               _entry("a", "recovered-in-place", 110.4, fault="peer-crashed", daemon_s=0.4,
                      duration_s=0.03, step=50),
               _entry("a", "job-completed", 150, step=100)]
    tl = build_timeline(entries, "j", as_of=999)
    (rec,) = tl["recoveries"]
    assert (rec["kind"], rec["duration_s"], rec["fault_t"]) == ("peer-crashed in place", 0.4,
                                                               pytest.approx(10.0))
