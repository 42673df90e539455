"""`elasticd status` against a real etcd holding malformed values, as anyone with write
access to the job's prefix could leave them: one clear warning naming the key, the rest
of the status, exit 0, never a traceback."""

from __future__ import annotations

import json
import pickle
import time
import uuid

import pytest
from click.testing import CliRunner

from elasticd.cli import main
from elasticd.ops.status import FAILED_EXIT_CODE, NO_SUCH_JOB_EXIT_CODE, STALLED_EXIT_CODE
from elasticd.rendezvous.keys import JobKeys


@pytest.fixture
def job_id() -> str:
    """Unique per test and per parameter (the suite's job_id cuts long parametrized names)."""
    return f"status-{uuid.uuid4().hex[:12]}"


def write_config(path, job_id: str, endpoint: str, root: str = "/elasticd"):
    path.write_text(f'[job]\nid = "{job_id}"\nentrypoint = ["train.py"]\n\n'
                    f'[etcd]\nendpoints = ["{endpoint}"]\nkey_prefix = "{root}"\n')
    return path


@pytest.fixture
def config(tmp_path, etcd_server, job_id):
    return write_config(tmp_path / "node.toml", job_id, etcd_server.endpoint)


def good_node(node: str = "n1") -> dict:
    return {"node_id": node, "state": "running", "addr": "127.0.0.1", "agent_pid": 123,
            "daemon_pid": 122, "updated": time.time()}


def status(config, *args: str, code: int = 0) -> str:
    """The command's stdout; it must exit ``code`` (0: running or completed; the job's
    state's otherwise) without an exception escaping it."""
    result = CliRunner().invoke(main, ["status", "--config", str(config), *args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert result.exit_code == code, result.output
    # stderr may carry torch's own import-time logging; the command's output is stdout.
    assert "Traceback" not in result.stdout
    return result.stdout


def test_well_formed_values_give_no_warning(client, config, job_id):
    keys = JobKeys(job_id)
    lease = client.grant_lease(30)
    client.put(keys.node("n1"), json.dumps(good_node()).encode(), lease=lease)
    client.put(keys.checkpoint_latest, json.dumps({"step": 40, "node": "n1"}).encode())
    client.put(f"{keys.events}00000000000000000001-n1",
               json.dumps({"kind": "node-joined", "node": "n1", "time": time.time()}).encode())
    out = status(config)
    assert "warning: " not in out
    assert "n1" in out and "running" in out and "newest checkpoint: step 40 (by n1)" in out
    assert "node-joined" in out
    client.revoke_lease(lease)


# (key under the job's prefix, raw value, words the warning line must contain)
MALFORMED = [
    ("nodes/n1", b"[]", "nodes/n1: not a JSON object"),
    ("nodes/n1", b"not json", "nodes/n1: not JSON"),
    ("nodes/n1", b"\xff\xfe", "nodes/n1: not JSON"),
    ("nodes/n1", json.dumps(good_node() | {"updated": "yesterday"}).encode(),
     "nodes/n1 updated: 'yesterday' is a str, expected int or float"),
    ("nodes/n1", json.dumps(good_node() | {"state": ["running"]}).encode(), "nodes/n1 state: ['running']"),
    ("nodes/n1", json.dumps(good_node() | {"node_id": {"x": 1}}).encode(), "nodes/n1 node_id"),
    ("nodes/n1", json.dumps(good_node() | {"agent_pid": "123"}).encode(), "nodes/n1 agent_pid: '123'"),
    ("nodes/n1", json.dumps(good_node() | {"daemon_pid": True}).encode(), "nodes/n1 daemon_pid: True"),
    ("state", b"completed", "/state: not JSON"),
    ("state", b'["completed"]', "/state: not a JSON object"),
    ("state", b'{"state": 3}', "/state state: 3 is a int, expected str"),
    ("checkpoint/latest", b"[40]", "checkpoint/latest: not a JSON object"),
    ("checkpoint/latest", b'{"step": "40", "node": "n1"}', "checkpoint/latest: step '40'"),
    ("checkpoint/latest", b'{"step": -1}', "checkpoint/latest: step -1"),
    ("checkpoint/latest", b'{"step": 40, "node": 7}', "checkpoint/latest node: 7"),
    ("events/00000000000000000002-x", b"[]", "events/00000000000000000002-x: journal entry is not a JSON"),
    ("events/00000000000000000002-x", b'{"kind": ["boom"], "node": "x", "time": 1}',
     "events/00000000000000000002-x: kind ['boom'] is not a string"),
    ("events/00000000000000000002-x", b'{"kind": "k", "node": "x", "time": "noon"}',
     "events/00000000000000000002-x: time 'noon' is not a positive number"),
    ("events/00000000000000000002-x", b'{"kind": "k", "node": "y", "time": 1}',
     "events/00000000000000000002-x: node 'y' is not the node in its key"),
    ("rdzv/state", b"not a pickle", "rdzv/state: the rendezvous state could not be read"),
    ("rdzv/state", pickle.dumps([1, 2]), "rdzv/state: the rendezvous state could not be read"),
]


@pytest.mark.parametrize(("suffix", "raw", "words"), MALFORMED,
                         ids=[f"{s}={r[:12]!r}" for s, r, _ in MALFORMED])
def test_a_malformed_value_is_one_warning_line(client, config, job_id, suffix, raw, words):
    keys = JobKeys(job_id)
    client.put(keys.prefix + suffix, raw)
    client.put(keys.node("n2"), json.dumps(good_node("n2")).encode())   # the rest still shows
    out = status(config)
    warnings = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, out
    assert words in warnings[0], out
    assert "treated as absent" in warnings[0] or "skipped" in warnings[0], out
    assert keys.prefix + suffix.split(" ")[0] in warnings[0]
    assert "n2" in out and out.startswith(f"job {job_id}: ")
    parsed = json.loads(status(config, "--json"))
    assert len(parsed["warnings"]) == 1 and words in parsed["warnings"][0]


def test_many_bad_values_at_once(client, config, job_id):
    keys = JobKeys(job_id)
    for suffix, raw, _ in MALFORMED:
        if suffix.startswith("events/"):
            suffix = f"{suffix}-{len(raw)}-{abs(hash(raw)) % 1000}"
        client.put(keys.prefix + suffix, raw)
    client.put(f"{keys.events}00000000000000000003-y", b'{"kind": "k", "node": "y", "time": 1e300}')
    out = status(config)
    assert f"job {job_id}: running" in out and "newest checkpoint: step 40 (by ?)" in out
    assert "??:??:??" in out     # a valid float beyond any date is shown, not a crash
    json.loads(status(config, "--json"))


def test_a_raising_rendezvous_decoder_is_a_line(client, config, job_id, monkeypatch):
    """Whatever the (hardened) state decoder raises is reported, not a traceback."""
    from elasticd.rendezvous import admin

    class Refused(Exception):
        pass

    def refuse(*_args):
        raise Refused("refusing to unpickle global os.system")

    monkeypatch.setattr(admin, "current_round", refuse)
    client.put(JobKeys(job_id).node("n1"), json.dumps(good_node()).encode())  # the job exists
    out = status(config)
    assert (f"warning: {JobKeys(job_id).rdzv_state}: the rendezvous state could not be read "
            "(Refused: refusing to unpickle global os.system)") in out


# -- a job etcd knows nothing of -------------------------------------------------------------

def test_a_job_with_no_key_in_etcd_is_an_error_naming_it(client, tmp_path, etcd_server, job_id):
    """Not `job ...: running` with rc 0: the job, the endpoints, what exists, how to list it."""
    root = f"/status-{uuid.uuid4().hex[:8]}"
    for other in ("job-a", "job-b"):
        client.put(f"{root}/{other}/nodes/n1", json.dumps(good_node()).encode())
    client.put(f"{root}/{job_id}x/state", b"{}")     # a longer id is another job
    config = write_config(tmp_path / "node.toml", job_id, etcd_server.endpoint, root)
    for args in ((), ("--json",)):
        result = CliRunner().invoke(main, ["status", "--config", str(config), *args])
        assert result.exit_code == NO_SUCH_JOB_EXIT_CODE == 4, result.output
        if args:
            assert json.loads(result.stdout) == {
                "job": job_id, "state": "unknown", "error": json.loads(result.stdout)["error"],
                "prefix": f"{root}/{job_id}/", "endpoints": [etcd_server.endpoint],
                "jobs": ["job-a", "job-b", f"{job_id}x"], "jobs_truncated": False,
                "config": str(config)}
            assert f"no job {job_id!r} in etcd" in json.loads(result.stdout)["error"]
        else:
            assert result.stdout == "", result.stdout
        err = result.stderr
        assert "running" not in err and "Traceback" not in err
        assert f"no job {job_id!r} in etcd: nothing under {root}/{job_id}/" in err, err
        assert etcd_server.endpoint in err and "`[job] id`" in err and str(config) in err
        assert f"Jobs under {root}/: job-a, job-b, {job_id}x." in err, err
        assert f"get --prefix --keys-only {root}/ | cut -d/ -f3" in err, err


def test_the_exit_statuses_are_in_the_help():
    result = CliRunner().invoke(main, ["status", "--help"])
    out = " ".join(result.output.split())
    assert result.exit_code == 0
    assert "4 unknown job: etcd holds no key of the job" in out, out
    assert f"{FAILED_EXIT_CODE} the job failed" in out and FAILED_EXIT_CODE == 3, out
    assert f"{STALLED_EXIT_CODE} the job is stalled" in out and STALLED_EXIT_CODE == 5, out
    assert '"state": "unknown"' in out


def test_an_unknown_job_whose_jobs_cannot_be_listed_is_still_json(client, tmp_path, etcd_server,
                                                                 job_id, monkeypatch):
    """A job's etcd user may read its own prefix only: ``jobs`` is null, the error says why."""
    from elasticd.errors import EtcdAuthError
    from elasticd.ops import status as status_module

    def refuse(*_args, **_kw):
        raise EtcdAuthError("permission denied")

    monkeypatch.setattr(status_module, "job_ids", refuse)
    config = write_config(tmp_path / "node.toml", job_id, etcd_server.endpoint)
    result = CliRunner().invoke(main, ["status", "--config", str(config), "--json"])
    assert result.exit_code == NO_SUCH_JOB_EXIT_CODE, result.output
    parsed = json.loads(result.stdout)
    assert parsed["state"] == "unknown" and parsed["jobs"] is None
    assert "could not be listed (permission denied)" in parsed["error"]


def test_job_ids_lists_each_job_once_and_stops_at_most(client):
    from elasticd.ops.status import job_ids

    root = f"/ids-{uuid.uuid4().hex[:8]}"
    for job in ("a", "a.b", "a0", "b", "c"):
        for key in ("nodes/n1", "nodes/n2", "state"):
            client.put(f"{root}/{job}/{key}", b"{}")
    client.put(f"{root}x/d/state", b"{}")            # another root
    assert job_ids(client, root) == ["a.b", "a", "a0", "b", "c"]   # key order: "." < "/"
    assert job_ids(client, root, most=2) == ["a.b", "a"]
    assert job_ids(client, f"/ids-{uuid.uuid4().hex[:8]}") == []


# -- events ------------------------------------------------------------------------------------

def journal(client, keys: JobKeys, node: str, kind: str, at: float, **fields) -> None:
    entry = {"kind": kind, "node": node, "time": at, **fields}
    client.put(f"{keys.events}{int(at * 1e9):020d}-{node}", json.dumps(entry).encode())


def test_events_are_readable_lines_and_json_keeps_them_raw(client, config, job_id):
    keys = JobKeys(job_id)
    at = time.time() - 60
    journal(client, keys, "n1", "peer-lost", at, peer="n2", how="crashed", step=40, world_size=3,
            round=2)
    journal(client, keys, "n1", "recovered-in-place", at + 1, fault="peer-crashed", duration_s=0.12,
            daemon_s=0.2, lost=["n2"], generation="2.1", step=40, world_size=2, round=2)
    journal(client, keys, "n1", "node-failed", at + 2, reason="the agent exited 3 times\nwithout "
            "progress", step=41, world_size=2, round=2)
    journal(client, keys, "n1", "job-completed", at + 3)
    out = status(config, code=STALLED_EXIT_CODE)     # no node record, no /state
    lines = out.split("recent events:\n", 1)[1].splitlines()
    clock = time.strftime("%H:%M:%S", time.localtime(at))
    assert lines[0] == f"  {clock} n1               peer-lost n2: crashed (step 40, world size 3, round 2)"
    assert lines[1].endswith("recovered-in-place: peer-crashed; duration_s 0.12, daemon_s 0.2, "
                             "lost n2, generation 2.1 (step 40, world size 2, round 2)"), lines
    assert lines[2].endswith("node-failed: the agent exited 3 times without progress "
                             "(step 41, world size 2, round 2)"), lines
    assert lines[3].endswith(" n1               job-completed"), lines
    assert not [line for line in lines if "{" in line or "'" in line], lines
    events = json.loads(status(config, "--json", code=STALLED_EXIT_CODE))["events"]
    assert events[0] == {"kind": "peer-lost", "node": "n1", "time": at, "peer": "n2",
                         "how": "crashed", "step": 40, "world_size": 3, "round": 2}
    assert events[1]["lost"] == ["n2"] and len(events) == 4


def test_events_shows_the_newest_entries(client, config, job_id):
    keys = JobKeys(job_id)
    for i in range(5):
        journal(client, keys, "n1", "progress", 1_000_000 + i, step=i)
    stalled = {"code": STALLED_EXIT_CODE}           # a journal, no node record
    steps = [e["step"] for e in json.loads(status(config, "--json", "--events", "2",
                                                  **stalled))["events"]]
    assert steps == [3, 4]
    assert json.loads(status(config, "--json", "--events", "0", **stalled))["events"] == []


# -- the job's state ---------------------------------------------------------------------------

def first_line(config, code: int = 0) -> str:
    return status(config, code=code).splitlines()[0]


def test_the_only_node_marked_failed_in_its_record_is_a_failed_job(client, config, job_id):
    keys = JobKeys(job_id)
    lease = client.grant_lease(30)
    record = good_node() | {"state": "failed", "reason": "crashed 3 times without progress",
                            "agent_pid": None}
    client.put(keys.node("n1"), json.dumps(record).encode(), lease=lease)
    out = status(config, code=FAILED_EXIT_CODE)
    assert out.splitlines()[0] == (f"job {job_id}: failed: every node marked failed "
                                   "(n1: crashed 3 times without progress)"), out
    assert "running" not in out.splitlines()[0]
    assert "reason: crashed 3 times without progress" in out    # the node's own line
    parsed = json.loads(status(config, "--json", code=FAILED_EXIT_CODE))
    assert parsed["state"] == "failed"
    assert parsed["failed_nodes"] == {"n1": "crashed 3 times without progress"}
    client.revoke_lease(lease)


def test_a_failed_node_whose_record_is_gone_is_failed_by_the_journal(client, config, job_id):
    """The failed daemon deletes its record as it exits: the journal's node-failed says why."""
    keys = JobKeys(job_id)
    at = time.time() - 30
    journal(client, keys, "n1", "node-joined", at)
    journal(client, keys, "n1", "agent-failed", at + 1, exit_code=1)
    journal(client, keys, "n1", "node-failed", at + 2, reason="the workers diverged")
    assert first_line(config, FAILED_EXIT_CODE) == (f"job {job_id}: failed: every node marked "
                                                    "failed (n1: the workers diverged)")


def test_one_of_two_nodes_failed_the_other_live_is_running_and_says_so(client, config, job_id):
    keys = JobKeys(job_id)
    lease = client.grant_lease(30)
    client.put(keys.node("n2"), json.dumps(good_node("n2")).encode(), lease=lease)
    journal(client, keys, "n1", "node-failed", time.time() - 5, reason="unfit")
    assert first_line(config) == f"job {job_id}: running: 1 live node; marked failed: n1: unfit"
    client.revoke_lease(lease)


def test_no_live_node_is_stalled_and_says_what_became_of_each(client, config, job_id):
    keys = JobKeys(job_id)
    at = time.time() - 30
    journal(client, keys, "n1", "node-joined", at)            # its record expired since
    journal(client, keys, "n2", "node-joined", at)
    journal(client, keys, "n2", "node-left", at + 1)
    journal(client, keys, "n3", "node-failed", at + 2, reason="unfit")
    client.put(keys.node("n4"), json.dumps(good_node("n4") | {"state": "leaving"}).encode())
    assert first_line(config, STALLED_EXIT_CODE) == (
        f"job {job_id}: stalled: no live node (n1: record gone; n2: left; n3: failed: unfit; "
        "n4: record leaving)")
    assert json.loads(status(config, "--json", code=STALLED_EXIT_CODE))["state"] == "stalled"


def test_a_job_with_keys_but_no_node_anywhere_is_stalled(client, config, job_id):
    client.put(JobKeys(job_id).checkpoint_latest, json.dumps({"step": 3, "node": "n1"}).encode())
    assert first_line(config, STALLED_EXIT_CODE) == (
        f"job {job_id}: stalled: no live node (no node record, and no node in the journal)")


def test_a_node_failed_then_restarted_is_live_again(client, config, job_id):
    keys = JobKeys(job_id)
    journal(client, keys, "n1", "node-failed", time.time() - 9, reason="crash loop")
    journal(client, keys, "n1", "node-joined", time.time() - 1)
    client.put(keys.node("n1"), json.dumps(good_node()).encode())
    assert first_line(config) == f"job {job_id}: running: 1 live node"


def test_completed_is_what_state_says(client, config, job_id):
    keys = JobKeys(job_id)
    client.put(keys.state, json.dumps({"state": "completed", "node": "n1", "time": 1}).encode())
    journal(client, keys, "n1", "job-completed", time.time() - 1)
    assert first_line(config) == f"job {job_id}: completed"


# -- the world after an in-place shrink ---------------------------------------------------------

def keyed_round(client, keys: JobKeys, round_: int, size: int, epoch: str = "e1") -> None:
    from elasticd.rendezvous.rounds import Agent, World, encode_pointer

    world = World(round_, tuple(Agent("127.0.0.1", 100 + i) for i in range(size)))
    client.put(keys.rdzv_epoch, epoch.encode())
    client.put(keys.rdzv_world(round_), world.encode())
    client.put(keys.rdzv_round, encode_pointer(world))


def agreed(client, keys: JobKeys, round_: int, seq: int, members: list[str], lost: list[str],
           epoch: str | None = "e1") -> None:
    from elasticd.contract.generation import GenerationId, GenerationRecord, renumber

    record = GenerationRecord(GenerationId(round_, seq, epoch), renumber((m, 1) for m in members),
                              "127.0.0.1:29400", tuple(lost), "peer-crashed", created=time.time())
    client.put(keys.generation, record.to_json().encode())


def world_of(config) -> tuple[str, dict]:
    """The world line and the JSON of a job with rounds but no node record (stalled)."""
    return (status(config, code=STALLED_EXIT_CODE).splitlines()[1],
            json.loads(status(config, "--json", code=STALLED_EXIT_CODE)))


def test_a_generation_newer_than_the_round_is_the_world(client, config, job_id):
    keys = JobKeys(job_id)
    keyed_round(client, keys, 5, 3)
    agreed(client, keys, 5, 1, ["n1", "n2"], ["n3"])
    line, parsed = world_of(config)
    assert line == ("rendezvous round 5, 2 node(s) in the world (generation 5.1, in place: n1, n2; "
                    "lost n3; the round formed with 3), 0 waiting"), line
    assert parsed["world_nodes"] == 2 and parsed["round_world_nodes"] == 3
    assert parsed["world_members"] == ["n1", "n2"] and parsed["world_source"] == "generation 5.1"
    assert parsed["generation"]["current"] is True and "epoch" not in parsed
    agreed(client, keys, 5, 2, ["n1"], ["n2", "n3"])             # a second shrink in the round
    assert world_of(config)[1]["world_nodes"] == 1


@pytest.mark.parametrize(("round_", "epoch"), [(4, "e1"), (5, "e0"), (5, None)],
                         ids=["an-older-round", "another-epoch", "no-epoch"])
def test_a_generation_of_another_round_or_epoch_is_not_the_world(client, config, job_id, round_, epoch):
    keys = JobKeys(job_id)
    keyed_round(client, keys, 5, 3)
    agreed(client, keys, round_, 1, ["n1", "n2"], ["n3"], epoch=epoch)
    line, parsed = world_of(config)
    assert line == "rendezvous round 5, 3 node(s) in the world, 0 waiting", line
    assert parsed["world_nodes"] == 3 and parsed["world_source"] == "round 5"
    assert parsed["generation"]["current"] is False


def test_torch_layout_a_generation_of_the_round_and_the_stores_epoch_is_the_world(client, config, job_id):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    keys = JobKeys(job_id)
    torch_state = dyn._RendezvousState()
    torch_state.round, torch_state.complete = 2, True
    torch_state.participants = {dyn._NodeDesc("127.0.0.1", 100 + i, 0): i for i in range(3)}
    client.put(keys.rdzv_state, pickle.dumps(torch_state))
    client.put(keys.store_epoch, b"0123abcd")
    agreed(client, keys, 2, 1, ["n1", "n2"], ["n3"], epoch="0123abcd")
    assert world_of(config)[1]["world_nodes"] == 2
    client.put(keys.store_epoch, b"another")        # the state was made anew since
    assert world_of(config)[1]["world_nodes"] == 3


def test_a_malformed_generation_is_a_warning_and_the_rounds_world(client, config, job_id):
    keys = JobKeys(job_id)
    keyed_round(client, keys, 5, 3)
    client.put(keys.generation, b'{"format": 1, "members": "all"}')
    out = status(config, code=STALLED_EXIT_CODE)
    assert "rendezvous round 5, 3 node(s) in the world, 0 waiting" in out
    assert f"warning: {keys.generation}: generation record field members" in out
