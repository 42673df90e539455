"""The daemon's action executors (``daemon.ACTIONS``) and its ``observe``, without processes.

Until these, the executors were exercised only through multi-process runs (30-120 s
each, a failure far from its cause). Here each executor runs on a ``Daemon`` that was
constructed but never ``run``: the parts ``_connect`` would make are put in by hand. The
etcd-facing ones (``Membership``, ``Journal``, ``JobReader``) are the real classes on the
session's real etcd (``etcd_server``; every test has its own job prefix, ``job_id``),
since a fake client that could serve leases, watches and transactions would be larger
than the code under test. What would start or signal processes, or open sockets and
threads, is a small fake: the agent, its workers, the prober, the checkpoint scanner,
the process-tree helpers (``proctree``, ``Daemon._tree``) and systemd (``FakeSystemd``).
Time is the fake clock. Every test asserts an effect another component sees: a key in
etcd, a file, a datagram, a signal sent, a metric, a field of the ``Snapshot``.

Not here: ``SHRINK`` (``inplace.agreement.shrink_world`` agrees a generation among the daemons'
TCP stores; see tests/daemon/test_recovery.py and the in-place runs). ``DRAIN_IN_PLACE`` is
here, on the real agreement: its effects are the record in etcd, the workers' file, the
leave file and the exit barrier's release.
"""

from __future__ import annotations

import itertools
import json
import os
import signal

import psutil
import pytest
from structlog.testing import capture_logs

import elasticd.daemon as daemon_module
from elasticd import proctree
from elasticd.actions import Kind, Outcome, act
from elasticd.agent import worker_env
from elasticd.config import config_from_dict
from elasticd.contract import generation
from elasticd.contract.generation import GenerationId, GenerationRecord, Member, WorldView
from elasticd.contract.settings import WorkerSettings
from elasticd.daemon import Daemon
from elasticd.errors import EtcdUnavailable
from elasticd.journal import Journal, recent_events
from elasticd.membership import Membership, Peer
from elasticd.observer import JobReader
from elasticd.rendezvous import entering
from elasticd.rendezvous.admin import exit_barrier_key
from elasticd.rendezvous.rounds import Agent, World, encode_pointer
from elasticd.sdnotify import SystemdNotifier
from elasticd.supervisor import Decision, Eviction, Memory, PeerView
from tests.daemon.test_sdnotify import FakeClock, FakeSystemd

ADDR = "10.0.0.1"          # this node's agent address
AGENT_PID = 4242           # a pid no test process has: nothing real is ever signalled
PEER_ADDR = "10.0.0.2"


# -- fakes ---------------------------------------------------------------------------------

class FakeProc:
    """A worker process as ``observe`` and ``torch_restart_count`` read it."""

    def __init__(self, pid: int, restart_count: int | None = None) -> None:
        self.pid = pid
        self.restart_count = restart_count
        self.environ_reads = 0
        self.signals: list[int] = []

    def environ(self) -> dict[str, str]:
        self.environ_reads += 1
        if self.restart_count is None:
            return {}
        return {"TORCHELASTIC_RESTART_COUNT": str(self.restart_count)}

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


class GoneProc(FakeProc):
    """A process that exited between the listing and the signal."""

    def send_signal(self, signum: int) -> None:
        raise psutil.NoSuchProcess(self.pid)


class FakeAgent:
    """The running torchrun agent as the daemon's loop reads it."""

    def __init__(self, pid: int | None = AGENT_PID, exit_code: int | None = None,
                 workers: list[FakeProc] | None = None) -> None:
        self.pid = pid
        self._exit = exit_code
        self._workers = workers or []

    def exit_code(self) -> int | None:
        return self._exit

    def workers(self, direct: bool = False) -> list[FakeProc]:
        return list(self._workers)


class FakeAgentProcess:
    """Stands in for ``AgentProcess`` in ``START_AGENT``: records what it was given."""

    made: list[FakeAgentProcess] = []

    def __init__(self, command, env, log_path, *, etcd_auth=None, warm=None) -> None:
        self.command, self.env, self.log_path, self.etcd_auth = command, env, log_path, etcd_auth
        self.warm = warm
        self.pid: int | None = None
        self.started_warm = False
        FakeAgentProcess.made.append(self)

    def start(self) -> int:
        self.pid = AGENT_PID
        return self.pid


class FakeProber:
    def __init__(self) -> None:
        self.confirmed: list[tuple[str, str | None]] = []
        self.refused: list[Peer] = []
        self.answers: dict[str, str] = {}
        self.confirmations: dict[str, str] = {}

    def confirm(self, node_id: str, endpoint: str | None) -> None:
        self.confirmed.append((node_id, endpoint))

    def take_refused(self) -> list[Peer]:
        out, self.refused = self.refused, []
        return out

    def take_answers(self) -> dict[str, str]:
        out, self.answers = self.answers, {}
        return out

    def take_confirmations(self) -> dict[str, str]:
        out, self.confirmations = self.confirmations, {}
        return out


class FakeScanner:
    def __init__(self) -> None:
        self.step: int | None = None
        self.pokes = 0

    def poke(self) -> None:
        self.pokes += 1


# -- fixtures ------------------------------------------------------------------------------

@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def daemon(tmp_path, job_id, client, clock):
    """A daemon wired as ``_connect`` would wire it, minus every thread, socket and process."""
    config = config_from_dict({
        "job": {"id": job_id, "entrypoint": ["train.py"], "min_nodes": 1, "max_nodes": 2},
        "node": {"id": "a", "run_dir": str(tmp_path / "run"), "addr": ADDR},
        "checkpoint": {"dir": str(tmp_path / "ckpt")}})
    d = Daemon(config, clock=clock, notifier=SystemdNotifier({}))
    d.client = client
    d.membership = Membership(client, d.keys, "a", config.node.lease_ttl_s,
                              {"addr": ADDR, "state": "starting"}, clock=clock)
    d.journal = Journal(client, d.keys, "a", clock=clock)
    d.jobs = JobReader(client, d.keys, "a", clock=clock)
    d.prober = FakeProber()
    d.scanner = FakeScanner()
    yield d
    d.membership.leave()   # cancels the watch a poll() made


_mtimes = itertools.count(1_000_000)


def write_progress(d: Daemon, **record) -> None:
    """A progress record as trainer/progress.py writes it, with an mtime of its own
    (``ProgressReader`` re-reads on an mtime change only)."""
    d.files.progress.write_text(json.dumps(record))
    t = next(_mtimes)
    os.utime(d.files.progress, (t, t))


def put_json(client, key: str, value, lease: int | None = None) -> None:
    client.put(key, json.dumps(value).encode(), lease=lease)


def get_json(client, key: str):
    kv = client.get(key)
    return None if kv is None else json.loads(kv.value)


def run(d: Daemon, kind: Kind, **data) -> None:
    """One action through the table, as the loop executes it (errors logged, not raised)."""
    d._execute(act(kind, **data))


def alive_agent(client, keys, agent: Agent) -> str:
    """A keyed-rounds liveness key for ``agent``, on a lease of its own (as the agent keeps)."""
    key = f"{keys.rdzv_alive}{agent.name}"
    put_json(client, key, agent.to_json(), lease=client.grant_lease(30))
    return key


# -- etcd-facing executors -----------------------------------------------------------------

def test_publish_writes_the_fields_into_this_nodes_record_in_etcd(daemon, client, keys):
    run(daemon, Kind.PUBLISH, fields={"state": "running", "agent_pid": AGENT_PID})
    record = get_json(client, keys.node("a"))
    assert record["state"] == "running" and record["agent_pid"] == AGENT_PID
    assert record["node_id"] == "a" and record["addr"] == ADDR   # the rest of the record kept
    assert not daemon.membership.dirty


def test_journal_appends_an_event_with_where_training_stood(daemon, client, keys):
    write_progress(daemon, event="step", step=7, world_size=4, rank=0)
    daemon.progress.read()
    run(daemon, Kind.JOURNAL, event="worker-restarted", fields={"cause": "crash"})
    [entry] = recent_events(client, keys)
    assert entry["kind"] == "worker-restarted" and entry["node"] == "a"
    assert (entry["step"], entry["world_size"], entry["round"], entry["cause"]) == (7, 4, None, "crash")


def test_delete_drain_key_deletes_this_nodes_drain_request_only(daemon, client, keys):
    put_json(client, keys.drain("a"), {"reason": "maintenance"})
    put_json(client, keys.drain("b"), {"reason": "maintenance"})
    run(daemon, Kind.DELETE_DRAIN_KEY)
    assert client.get(keys.drain("a")) is None
    assert client.get(keys.drain("b")) is not None


def test_mark_completed_writes_the_jobs_state_as_this_node(daemon, client, keys):
    run(daemon, Kind.MARK_COMPLETED)
    state = get_json(client, keys.state)
    assert state["state"] == "completed" and state["node"] == "a" and state["time"] > 0


def test_publish_checkpoint_writes_the_latest_hint_and_the_gauge(daemon, client, keys):
    run(daemon, Kind.PUBLISH_CHECKPOINT, step=120)
    latest = get_json(client, keys.checkpoint_latest)
    assert (latest["step"], latest["node"], latest["dir"]) == (120, "a", daemon.config.checkpoint.dir)
    assert daemon.metrics.registry.get_sample_value("elasticd_checkpoint_step") == 120


def test_reopen_rendezvous_deletes_the_keyed_closed_key(daemon, client, keys):
    client.put(keys.rdzv_closed, b"1")
    run(daemon, Kind.REOPEN_RENDEZVOUS)
    assert client.get(keys.rdzv_closed) is None


def test_leave_rendezvous_revokes_our_agents_liveness_only(daemon, client, keys):
    ours = alive_agent(client, keys, Agent(ADDR, AGENT_PID))
    theirs = alive_agent(client, keys, Agent(PEER_ADDR, 77))
    daemon.agent = FakeAgent()
    run(daemon, Kind.LEAVE_RENDEZVOUS)
    assert client.get(ours) is None
    assert client.get(theirs) is not None


def test_leave_rendezvous_without_an_agent_touches_nothing(daemon, client, keys):
    ours = alive_agent(client, keys, Agent(ADDR, AGENT_PID))
    run(daemon, Kind.LEAVE_RENDEZVOUS)
    assert client.get(ours) is not None


def test_evict_revokes_a_dead_peers_liveness_and_says_it_was_in_the_round(daemon, client, keys):
    dead, alive = Agent(PEER_ADDR, 77), Agent(ADDR, AGENT_PID)
    world = World(3, (alive, dead))
    client.put(keys.rdzv_world(3), world.encode())
    client.put(keys.rdzv_round, encode_pointer(world))
    dead_key, our_key = alive_agent(client, keys, dead), alive_agent(client, keys, alive)
    run(daemon, Kind.EVICT, peers=(PeerView("b", agent=(PEER_ADDR, 77)),))
    assert client.get(dead_key) is None and client.get(our_key) is not None
    assert daemon.observe().eviction == Eviction(("b",), ok=True, in_round=True)


def test_evict_of_an_agent_another_daemon_removed_first_leaves_in_round_unknown(daemon, client, keys):
    alive_agent(client, keys, Agent(ADDR, AGENT_PID))     # keyed rounds, the peer already gone
    run(daemon, Kind.EVICT, peers=(PeerView("b", agent=(PEER_ADDR, 77)),))
    assert daemon.observe().eviction == Eviction(("b",), ok=True, in_round=None)


def test_evict_returns_what_it_removed_for_the_cycles_line(daemon, client, keys):
    dead = Agent(PEER_ADDR, 77)
    world = World(3, (Agent(ADDR, AGENT_PID), dead))
    client.put(keys.rdzv_world(3), world.encode())
    client.put(keys.rdzv_round, encode_pointer(world))
    alive_agent(client, keys, dead)
    out = daemon._execute(act(Kind.EVICT, peers=(PeerView("b", agent=(PEER_ADDR, 77)),)))
    assert out == Outcome(f"evicted {dead.name} from the rendezvous",
                          {"evicted": ["b"], "removed": [dead.name]})


def test_an_eviction_etcd_refuses_is_a_failed_outcome_and_retried(daemon):
    class DownClient:
        def __getattr__(self, name):
            raise EtcdUnavailable("etcd is down")

    daemon.client = DownClient()
    with capture_logs() as logs:
        out = daemon._execute(act(Kind.EVICT, peers=(PeerView("b", agent=(PEER_ADDR, 77)),)))
    assert out.failed and "etcd is down" in out.text and out.fields == {"evict_failed": ["b"]}
    assert daemon._eviction == Eviction(("b",), ok=False)      # the policy retries it
    assert logs == []                                           # the cycle's line says it


def test_the_cycle_logs_one_line_naming_the_decision_and_what_its_actions_did(daemon):
    decision = Decision(Memory(), (act(Kind.EVICT, peers=()), act(Kind.SHRINK)),
                        "peer(s) b lost; evicting them")
    done = [Outcome("evicted 10.0.0.2_77_0 from the rendezvous", {"evicted": ["b"]}),
            Outcome("generation 4.1 agreed", {"generation": "4.1", "generation_status": "ok"})]
    with capture_logs() as logs:
        daemon._log(decision, daemon.observe(), done)
    [line] = logs
    assert line["event"] == ("peer(s) b lost; evicting them (evicted 10.0.0.2_77_0 from the "
                             "rendezvous; generation 4.1 agreed)")
    assert (line["log_level"], line["evicted"], line["generation_status"]) == ("info", ["b"], "ok")
    assert line["actions"] == ["evict", "shrink"]
    with capture_logs() as logs:
        daemon._log(Decision(Memory()), daemon.observe(), [Outcome("no luck", failed=True)])
    assert [(e["event"], e["log_level"]) for e in logs] == [("no luck", "warning")]


def test_evict_of_peers_without_an_agent_needs_no_etcd(daemon):
    daemon.client = None        # any etcd call would fail the action ("action failed")
    with capture_logs() as logs:
        run(daemon, Kind.EVICT, peers=(PeerView("b"), PeerView("c", agent=None)))
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
    assert daemon._eviction == Eviction(("b", "c"), ok=True, in_round=False)


def test_an_etcd_error_in_an_executor_is_logged_for_a_later_cycle_not_raised(daemon):
    class DownClient:
        def delete(self, key: str) -> bool:
            raise EtcdUnavailable("etcd is down")

    daemon.client = DownClient()
    with capture_logs() as logs:
        run(daemon, Kind.DELETE_DRAIN_KEY)
    [warning] = [e for e in logs if e["event"] == "etcd call failed; a later cycle retries"]
    assert warning["action"] == "delete_drain_key" and "etcd is down" in warning["reason"]


def test_start_agent_starts_torchrun_and_publishes_and_journals_its_pid(daemon, client, keys,
                                                                        monkeypatch):
    FakeAgentProcess.made.clear()
    monkeypatch.setattr(daemon_module, "AgentProcess", FakeAgentProcess)
    daemon.files.stop.touch()                         # the last life's coordinated stop
    daemon.files.leave.touch()                        # ... and drain in place
    daemon.files.enter.touch()                        # ... and join in place
    daemon.worker_errors.last = "RuntimeError: the last life's cause"
    run(daemon, Kind.START_AGENT, enter=None)
    [agent] = FakeAgentProcess.made
    assert daemon.agent is agent and agent.pid == AGENT_PID
    assert agent.warm is daemon.warm_host   # forked there once it is ready (elasticd.agent)
    assert "torch.distributed.run" in agent.command and f"--local-addr={ADDR}" in agent.command
    assert agent.log_path == daemon.files.agent_log
    assert WorkerSettings.from_env(agent.env).node_id == "a"
    assert not daemon.files.stop.exists()             # the new workers must not stop at once
    assert not daemon.files.leave.exists()            # ... nor the new agent leave
    assert not daemon.files.enter.exists()            # ... nor take a round of its own
    assert daemon.worker_errors.last is None
    record = get_json(client, keys.node("a"))
    assert (record["state"], record["agent_pid"]) == ("running", AGENT_PID)
    [entry] = recent_events(client, keys)
    assert (entry["kind"], entry["agent_pid"], entry["start"]) == ("agent-started", AGENT_PID, "cold")
    assert daemon.metrics.registry.get_sample_value("elasticd_agent_starts_total") == 1


# -- the drain in place --------------------------------------------------------------------

def _world_of_two(daemon, client, keys, gen: GenerationId) -> None:
    """Our workers (ranks 0-1) and b's (ranks 2-3) in ``gen``, both daemons with a store."""
    write_progress(daemon, event="step", step=7, world_size=4, rank=0, local_world_size=2,
                   generation=gen.as_dict())
    put_json(client, keys.node("b"), {
        "state": "running", "agent_pid": 77, "addr": PEER_ADDR, "store": f"{PEER_ADDR}:29601",
        "world": WorldView("b", gen, 2, 2, 4).to_record()})
    client.put(keys.rdzv_round, encode_pointer(World(gen.round, (Agent(ADDR, AGENT_PID),
                                                                  Agent(PEER_ADDR, 77)))))
    daemon.observe()   # lists b's record


def test_drain_in_place_agrees_hands_over_and_keeps_the_agent_out_of_later_rounds(daemon, client,
                                                                                   keys):
    gen = GenerationId(3, 0, "e")
    _world_of_two(daemon, client, keys, gen)
    told = WorkerSettings.from_env(worker_env(daemon.config, daemon.files, base={})).leave_file
    assert told == str(daemon.files.leave) and not os.path.exists(told)
    with capture_logs():
        out = daemon._execute(act(Kind.DRAIN_IN_PLACE, generation=gen))
    assert not out.failed and "without this node" in out.text, out
    record = GenerationRecord.from_json(client.get(keys.generation).value)
    assert record.nodes == ("b",) and record.planned and record.lost == ("a",)
    assert record.store == f"{PEER_ADDR}:29601"   # b is the new rank 0
    assert generation.read_file(str(daemon.files.generation)) == record
    assert os.path.exists(told)                   # the agent joins no further round
    assert client.get(exit_barrier_key(keys, gen.round)) is not None
    snap = daemon.observe()
    assert snap.drained.status == "ok" and snap.drained.record == record
    assert daemon.observe().drained is None       # one snapshot


def test_a_drain_without_survivors_is_a_failed_outcome_and_touches_nothing(daemon, client, keys):
    gen = GenerationId(3, 0, "e")
    write_progress(daemon, event="step", step=7, world_size=2, rank=0, local_world_size=2,
                   generation=gen.as_dict())
    daemon.observe()   # reads it
    out = daemon._execute(act(Kind.DRAIN_IN_PLACE, generation=gen))
    assert out.failed and "no survivors" in out.text
    assert client.get(keys.generation) is None and not daemon.files.leave.exists()
    assert not daemon.files.generation.exists()
    assert daemon.observe().drained.status == "failed"


# -- the join in place ---------------------------------------------------------------------

def test_start_agent_to_enter_in_place_leaves_the_live_generation_in_the_enter_file(
        daemon, monkeypatch):
    monkeypatch.setattr(daemon_module, "AgentProcess", FakeAgentProcess)
    gen = GenerationId(3, 1, "e")
    run(daemon, Kind.START_AGENT, enter=gen)
    told = WorkerSettings.from_env(FakeAgentProcess.made[-1].env).enter_file
    assert told == str(daemon.files.enter)
    assert entering.Entry.from_json(daemon.files.enter.read_bytes()).generation == GenerationId(
        3, 0, "e")   # the round and epoch: the newcomers accept any re-form of it


def test_grow_in_place_agrees_the_generation_with_this_node_after_the_members(daemon, client,
                                                                             keys):
    gen = GenerationId(3, 0, "e")
    write_progress(daemon, event="warm", step=0, world_size=2, rank=0, local_world_size=2,
                   generation=gen.as_dict())   # our newcomers: their own world, not the job's
    put_json(client, keys.node("b"), {
        "state": "running", "agent_pid": 77, "addr": PEER_ADDR, "store": f"{PEER_ADDR}:29601",
        "world": WorldView("b", gen, 0, 2, 2).to_record()})
    assert daemon.observe().world is None
    with capture_logs():
        out = daemon._execute(act(Kind.GROW_IN_PLACE, live=gen, others=()))
    assert not out.failed and "with this node" in out.text, out
    record = GenerationRecord.from_json(client.get(keys.generation).value)
    assert record.id == gen.next() and record.planned and record.joined == ("a",)
    assert [(m.node, m.first_rank, m.nproc) for m in record.members] == [("b", 0, 2), ("a", 2, 2)]
    assert record.store == f"{PEER_ADDR}:29601"   # b stays rank 0
    assert generation.read_file(str(daemon.files.generation)) == record
    assert daemon.observe().grown.status == "ok"
    # Asked again for the world it has already changed: the change is adopted, not redone.
    again = daemon._execute(act(Kind.GROW_IN_PLACE, live=gen, others=()))
    assert "adopted" in again.text and client.get(keys.generation).value == record.to_json().encode()


def test_grow_in_place_takes_the_other_warm_newcomers_into_the_same_generation(daemon, client, keys):
    gen = GenerationId(3, 0, "e")
    write_progress(daemon, event="warm", step=0, world_size=1, rank=0, local_world_size=1,
                   generation=gen.as_dict())
    put_json(client, keys.node("b"), {
        "state": "running", "agent_pid": 77, "addr": PEER_ADDR, "store": f"{PEER_ADDR}:29601",
        "world": WorldView("b", gen, 0, 1, 1).to_record()})
    daemon.observe()
    out = daemon._execute(act(Kind.GROW_IN_PLACE, live=gen, others=(("0c", 2),)))
    assert not out.failed, out
    record = GenerationRecord.from_json(client.get(keys.generation).value)
    assert record.joined == ("0c", "a")   # node order, like every newcomer computes it
    assert [(m.node, m.first_rank, m.nproc) for m in record.members] == [("b", 0, 1), ("0c", 1, 2),
                                                                         ("a", 3, 1)]


def test_a_grow_of_a_world_that_changed_first_is_a_failed_outcome(daemon, client, keys):
    gen = GenerationId(3, 0, "e")
    put_json(client, keys.node("b"), {
        "state": "running", "agent_pid": 77, "addr": PEER_ADDR, "store": f"{PEER_ADDR}:29601",
        "world": WorldView("b", gen, 0, 2, 2).to_record()})
    daemon.observe()
    out = daemon._execute(act(Kind.GROW_IN_PLACE, live=GenerationId(2, 0, "e"), others=()))
    assert out.failed and "no join in place" in out.text
    assert client.get(keys.generation) is None and not daemon.files.generation.exists()


# -- local executors -------------------------------------------------------------------------

def test_touch_stop_file_creates_the_file_the_workers_are_told_to_watch(daemon):
    told = WorkerSettings.from_env(worker_env(daemon.config, daemon.files, base={})).stop_file
    assert not os.path.exists(told)
    run(daemon, Kind.TOUCH_STOP_FILE)
    assert os.path.exists(told) and told == str(daemon.files.stop)


def test_write_generation_hands_the_record_to_the_workers_file(daemon):
    record = GenerationRecord(GenerationId(3, 1, "e"), (Member("a", 0, 2), Member("b", 2, 2)),
                              lost=("c",), cause="peer-crashed")
    run(daemon, Kind.WRITE_GENERATION, record=record)
    assert generation.read_file(str(daemon.files.generation)) == record


def test_notify_sends_ready_and_stopping_to_systemd(daemon, tmp_path):
    systemd = FakeSystemd(str(tmp_path / "notify.sock"), str(tmp_path / "notify.sock"))
    try:
        daemon.notifier = SystemdNotifier(systemd.env())
        run(daemon, Kind.NOTIFY, what="ready")
        run(daemon, Kind.NOTIFY, what="stopping")
        with capture_logs() as logs:
            run(daemon, Kind.NOTIFY, what="reloading")     # not one NOTIFY may ask for
        assert systemd.received() == [b"READY=1", b"STOPPING=1"]
        assert [e["event"] for e in logs] == ["action failed"]
    finally:
        systemd.close()


def test_count_and_observe_feed_the_labelled_metrics(daemon):
    run(daemon, Kind.COUNT, metric="worker_restarts", label="crash")
    run(daemon, Kind.COUNT, metric="worker_restarts", label="crash")
    run(daemon, Kind.OBSERVE, metric="recovery_seconds", label="peer-crashed", value=2.5)
    sample = daemon.metrics.registry.get_sample_value
    assert sample("elasticd_worker_restarts_total", {"cause": "crash"}) == 2
    assert sample("elasticd_worker_restarts_total", {"cause": "hang"}) is None
    assert sample("elasticd_recovery_seconds_count", {"kind": "peer-crashed"}) == 1
    assert sample("elasticd_recovery_seconds_sum", {"kind": "peer-crashed"}) == 2.5


def test_confirm_peer_asks_the_prober_to_probe_that_peer_once_more(daemon):
    run(daemon, Kind.CONFIRM_PEER, peer=PeerView("b", probe=f"{PEER_ADDR}:9000"))
    assert daemon.prober.confirmed == [("b", f"{PEER_ADDR}:9000")]


def test_terminate_agent_sends_sigterm_to_the_whole_tree(daemon, monkeypatch):
    tree = [FakeProc(11), GoneProc(12), FakeProc(13), FakeProc(AGENT_PID)]
    asked: list[int] = []
    monkeypatch.setattr(daemon, "_tree", lambda pid: asked.append(pid) or tree)
    daemon.agent = FakeAgent()
    run(daemon, Kind.TERMINATE_AGENT)
    assert asked == [AGENT_PID]
    # One process already gone does not spare the others.
    assert [p.signals for p in tree] == [[signal.SIGTERM], [], [signal.SIGTERM], [signal.SIGTERM]]


def test_terminate_and_kill_agent_without_an_agent_signal_nothing(daemon, monkeypatch):
    calls: list[object] = []
    monkeypatch.setattr(daemon, "_tree", lambda pid: calls.append(("tree", pid)) or [])
    monkeypatch.setattr(proctree, "kill_tree", lambda pid, **kw: calls.append(("kill", pid)))
    for agent in (None, FakeAgent(pid=None)):          # never started; started, no pid
        daemon.agent = agent
        run(daemon, Kind.TERMINATE_AGENT)
        run(daemon, Kind.KILL_AGENT)
    assert calls == []


def test_kill_agent_kills_the_agents_tree(daemon, monkeypatch):
    killed: list[int] = []
    monkeypatch.setattr(proctree, "kill_tree", lambda pid, **kw: killed.append(pid) or [])
    daemon.agent = FakeAgent()
    run(daemon, Kind.KILL_AGENT)
    assert killed == [AGENT_PID]


def test_kill_workers_kills_each_named_worker_with_its_descendants(daemon, monkeypatch):
    trees = {11: [FakeProc(111), FakeProc(11)], 12: [FakeProc(12)]}
    killed: list[list[int]] = []
    monkeypatch.setattr(daemon, "_tree", lambda pid: trees[pid])
    monkeypatch.setattr(proctree, "kill_processes",
                        lambda procs, **kw: killed.append([p.pid for p in procs]) or [])
    out = daemon._execute(act(Kind.KILL_WORKERS, pids=(11, 12)))
    assert killed == [[111, 11, 12]]
    assert out == Outcome("killed 3 worker process(es)")      # for the cycle's line


# -- observe --------------------------------------------------------------------------------

def test_observe_before_any_agent_or_progress_knows_nothing_of_training(daemon, clock):
    clock.now = 321.5
    snap = daemon.observe()
    assert snap.now == 321.5 and snap.node_id == "a" and snap.agent_addr == ADDR
    assert (snap.agent_pid, snap.agent_exit, snap.workers, snap.workers_restart_count) == (
        None, None, frozenset(), None)
    assert (snap.step, snap.progress_event, snap.generation, snap.world) == (None, None, None, None)
    assert not snap.rank0_here and snap.job_state is None and snap.drain_request is None


def test_observe_reads_the_progress_file_the_agent_and_the_fake_clock(daemon, clock):
    write_progress(daemon, event="step", step=7, world_size=4, rank=0, local_world_size=2,
                   restart_count=1, generation={"round": 3, "seq": 1, "epoch": "e"})
    daemon.agent = FakeAgent(exit_code=None, workers=[FakeProc(11, restart_count=2), FakeProc(12)])
    clock.now = 200.0
    snap = daemon.observe()
    assert snap.now == 200.0
    assert (snap.agent_pid, snap.agent_exit, snap.workers) == (AGENT_PID, None, frozenset({11, 12}))
    assert snap.workers_restart_count == 2
    assert (snap.step, snap.progress_event, snap.rank0_here) == (7, "step", True)
    gen = GenerationId(3, 1, "e")
    assert snap.generation == gen and snap.world == WorldView("a", gen, 0, 2, 4)


def test_observe_reports_an_exited_agent_and_a_progress_reason(daemon):
    write_progress(daemon, event="unfit", step=3, rank=2, reason="no NCCL here")
    daemon.agent = FakeAgent(exit_code=1)
    snap = daemon.observe()
    assert (snap.agent_pid, snap.agent_exit, snap.workers) == (AGENT_PID, 1, frozenset())
    assert (snap.progress_event, snap.progress_reason, snap.rank0_here) == ("unfit", "no NCCL here",
                                                                           False)


def test_observe_reads_the_restart_count_once_per_worker_group(daemon):
    first = FakeProc(11, restart_count=0)
    daemon.agent = FakeAgent(workers=[first])
    assert [daemon.observe().workers_restart_count for _ in range(3)] == [0, 0, 0]
    assert first.environ_reads == 1
    daemon.agent = FakeAgent(workers=[FakeProc(21, restart_count=1)])   # torch restarted them
    assert daemon.observe().workers_restart_count == 1


def test_observe_reads_the_jobs_keys_once_a_second_by_the_clock(daemon, client, keys, clock):
    assert daemon.observe().job_state is None
    put_json(client, keys.state, {"state": "completed", "node": "b"})
    put_json(client, keys.drain("a"), {"reason": "maintenance"})
    clock.now += 0.5
    assert daemon.observe().job_state is None            # not due yet: the last view
    clock.now += 0.5
    snap = daemon.observe()
    assert snap.job_state == "completed"
    assert snap.drain_request == "`elasticd drain` asked for it: maintenance"


def test_observe_reads_the_keyed_round_and_the_agreed_generation(daemon, client, keys):
    world = World(3, (Agent(ADDR, AGENT_PID), Agent(PEER_ADDR, 77)))
    client.put(keys.rdzv_world(3), world.encode())
    client.put(keys.rdzv_round, encode_pointer(world))
    client.put(keys.rdzv_closed, b"1")
    agreed = GenerationRecord(GenerationId(3, 1, "e"), (Member("a", 0, 2),), lost=("b",))
    client.put(keys.generation, agreed.to_json().encode())
    snap = daemon.observe()
    assert (snap.round, snap.rdzv_closed) == (3, True)
    assert snap.round_members == {(ADDR, AGENT_PID), (PEER_ADDR, 77)}
    assert snap.generation_record == agreed


def test_a_signals_drain_request_comes_before_the_drain_key(daemon, client, keys):
    put_json(client, keys.drain("a"), {"reason": "maintenance"})
    daemon._on_stop_signal(signal.SIGTERM, None)
    snap = daemon.observe()
    assert snap.drain_request == "SIGTERM was received" and snap.stop_signals == 1


def test_observe_publishes_our_record_and_lists_the_peers_in_etcd(daemon, client, keys):
    put_json(client, keys.node("b"), {"state": "running", "agent_pid": 77, "addr": PEER_ADDR,
                                      "probe": f"{PEER_ADDR}:9000"})
    revision = client.get(keys.node("b")).mod_revision
    snap = daemon.observe()
    assert snap.peers == {"b": PeerView("b", "running", (PEER_ADDR, 77), revision, f"{PEER_ADDR}:9000")}
    assert get_json(client, keys.node("a"))["state"] == "starting"   # the dirty record, published


def test_observe_takes_the_probers_news_once(daemon):
    daemon.prober.refused = [Peer("b", {"state": "running"}, 5)]
    daemon.prober.answers = {"b": "refused", "c": "alive"}
    daemon.prober.confirmations = {"d": "silent"}
    snap = daemon.observe()
    assert snap.refused == (PeerView("b", "running", None, 5),)
    assert snap.probe_answers == {"b": "refused", "c": "alive"}
    assert snap.confirmations == {"d": "silent"}
    again = daemon.observe()
    assert (again.refused, again.probe_answers, again.confirmations) == ((), {}, {})


def test_observe_pokes_the_checkpoint_scan_once_per_new_checkpoint_like_record(daemon):
    daemon.scanner.step = 100
    write_progress(daemon, event="checkpoint", step=100)
    assert daemon.observe().checkpoint_step == 100
    daemon.observe()                                      # the same record: no second scan
    assert daemon.scanner.pokes == 1
    write_progress(daemon, event="step", step=101)
    daemon.observe()
    assert daemon.scanner.pokes == 1
    write_progress(daemon, event="stopped", step=101)
    daemon.observe()
    assert daemon.scanner.pokes == 2


def test_observe_names_the_workers_last_exception_from_the_agent_log(daemon):
    daemon.files.agent_log.write_text(
        "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
        "RuntimeError: ProcessGroupNCCL is only supported with GPUs\n")
    assert daemon.observe().worker_error == "RuntimeError: ProcessGroupNCCL is only supported with GPUs"


def test_an_eviction_outcome_reaches_exactly_one_snapshot(daemon):
    run(daemon, Kind.EVICT, peers=(PeerView("b"),))
    assert daemon.observe().eviction == Eviction(("b",), ok=True, in_round=False)
    assert daemon.observe().eviction is None
