"""The node daemon's loop: read one snapshot, decide (supervisor.decide), act, log.

Each cycle logs at most one sentence, the decision's reason, with the job,
node, round, world size and action bound; tests assert on those sentences.
The loop never waits on etcd for long: every etcd call on it fails fast and is
retried by a later cycle, so an etcd outage delays membership changes only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from elasticd import __version__, proctree
from elasticd.agent import AgentProcess, RunFiles, prune_log_dirs, torchrun_command, worker_env
from elasticd.config import RELOADABLE, Config, load_config
from elasticd.errors import ElasticdError, EtcdError
from elasticd.etcd_client import EtcdClient, no_retry
from elasticd.journal import Journal
from elasticd.membership import Membership, Peer
from elasticd.metrics import Metrics
from elasticd.preemption import Notice, PreemptionWatcher
from elasticd.probe import Liveness, Prober, ProbeServer, probe
from elasticd.rendezvous import admin, state_ops
from elasticd.rendezvous.keys import JobKeys
from elasticd.sdnotify import SystemdNotifier, WatchdogGate
from elasticd.supervisor import Action, Decision, Phase, Policy, View, decide, restart_cause

log = structlog.get_logger("elasticd.daemon")

TICK_S = 0.1
# After a peer crashed (or left), gloo makes our workers fail by themselves within
# ~0.1 s, and rank 0 then commits the last completed step. Killing them at once would
# race that save (measured: 17 steps lost), so a crash gets this grace; a silent peer
# leaves them hung in a collective and they are killed at once.
KILL_GRACE_S = 2.0
# Exit status of a node marked failed (crash loop): the unit's RestartPreventExitStatus
# lists it, so systemd does not restart a node whose script keeps crashing.
FAILED_EXIT_CODE = 3
JOB_STATE_EVERY_S = 1.0
CHECKPOINT_EVERY_S = 2.0
CONFIRM_TIMEOUT_S = 0.5


class Daemon:
    def __init__(self, config: Config, *, config_path: str | None = None, clock=time.monotonic,
                 notifier: SystemdNotifier | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self._reload_requested = False
        self._last_membership_change = float("-inf")
        self._workers: frozenset[int] = frozenset()
        self.preemption: PreemptionWatcher | None = None
        self.metrics = Metrics()
        self.clock = clock
        self.keys = JobKeys(config.job.id, config.etcd.key_prefix)
        self.node_id = config.node.id
        run_dir = config.node.run_dir or tempfile.mkdtemp(prefix=f"elasticd-{self.node_id}-")
        log_dir = Path(config.node.log_dir) if config.node.log_dir else None
        self.files = RunFiles(Path(run_dir), log_dir)
        self.files.run_dir.mkdir(parents=True, exist_ok=True)
        self.policy = _policy(config)
        self.notifier = notifier or SystemdNotifier()
        self.watchdog = WatchdogGate.for_notifier(self.notifier, clock=clock)
        self._pinged_at = float("-inf")
        self.phase = Phase.IDLE
        self.agent: AgentProcess | None = None
        self._exit_seen = False
        self.failures: list[float] = []
        self.restart_at = 0.0
        self.drain_reason: str | None = None
        self.hard_stop = False
        self.dead: dict[str, Peer] = {}
        self._death_kind: dict[str, str] = {}
        self._pending_kill: tuple[float, frozenset[int]] | None = None
        self._left_rdzv = False
        self.job_state: str | None = None
        self.round: int | None = None
        self.completed_seen_at: float | None = None
        self._job_state_read_at = float("-inf")
        self.progress: dict[str, Any] = {}
        self._progress_mtime = 0.0
        self._step_at_start: int | None = None
        self._last_reason = ""
        self._checkpoint_read_at = float("-inf")
        self._status_sent_at = float("-inf")
        self._known_peers: frozenset[str] = frozenset()
        self._published_step: int | None = None
        self._ready_sent = False
        self._terminator: threading.Thread | None = None
        self.log = log.bind(job=config.job.id, node=self.node_id)

    # -- life cycle --------------------------------------------------------------------

    def run(self) -> int:
        """Run until the job completes, the node fails, or a drain finishes; the exit code."""
        proctree.become_subreaper()
        self._install_signals()
        self._connect()
        try:
            while not self.phase.final and not self.hard_stop:
                self.cycle()
                time.sleep(TICK_S)
        finally:
            self._shutdown()
        if self.phase is Phase.FAILED:
            return FAILED_EXIT_CODE
        return 1 if self.hard_stop else 0

    def _connect(self) -> None:
        self.client = EtcdClient(self.config.etcd.settings(retry_s=30.0))
        self.probe_server = ProbeServer(self.config.node.addr).start()
        self.membership = Membership(self.client, self.keys, self.node_id,
                                     self.config.node.lease_ttl_s, self._initial_record(),
                                     clock=self.clock)
        self.membership.register()
        self.journal = Journal(self.client, self.keys, self.node_id)
        self.journal.record("node-joined")
        self.prober = Prober(self.membership.peers, self.config.node.probe_interval_s).start()
        self._start_preemption_watcher()
        if self.config.metrics.port:
            self.metrics.serve(self.config.metrics.addr, self.config.metrics.port)
        self.log.info("registered in etcd; watching peers", probe=self.probe_server.endpoint,
                      run_dir=str(self.files.run_dir))

    def _start_preemption_watcher(self) -> None:
        if self.preemption is not None:
            self.preemption.stop()
            self.preemption = None
        if self.config.preemption.enabled:
            self.preemption = PreemptionWatcher(self.config.preemption, self._on_notice).start()

    def _on_notice(self, notice: Notice) -> None:
        deadline = f", {notice.deadline_s:.0f} s left" if notice.deadline_s is not None else ""
        self.request_drain(f"a {notice.provider} preemption notice arrived ({notice.reason}{deadline})")

    def _initial_record(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "addr": self.config.node.addr,
                "daemon_pid": os.getpid(), "probe": self.probe_server.endpoint,
                "version": __version__, "state": "starting", "devices": _devices()}

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "_reload_requested", True))

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        if self.drain_reason is None:
            self.drain_reason = f"{signal.Signals(signum).name} was received"
        else:
            self.hard_stop = True  # a second signal: stop now

    def request_drain(self, reason: str) -> None:
        if self.drain_reason is None:
            self.drain_reason = reason

    # -- one cycle ---------------------------------------------------------------------

    def cycle(self) -> Decision:
        if self._reload_requested:
            self._reload_requested = False
            self.reload()
        self.membership.poll()
        self._read_job_state()
        self._read_progress()
        self._confirm_dead_peers()
        self._watch_workers()
        self._kill_stuck_workers()
        self._leave_early_when_drained()
        view = self._view()
        decision = decide(view, self.policy)
        if view.agent_exit is not None:
            self._exit_seen = True
        self._act(decision)
        self.phase = decision.phase
        self._update_metrics()
        self._log_decision(decision)
        self._ping_watchdog()
        return decision

    def _ping_watchdog(self) -> None:
        """WATCHDOG=1 from the main loop only, so a hung loop gets restarted by systemd."""
        if self.watchdog is None:
            return
        self.watchdog.beat()
        if self.clock() - self._pinged_at >= self.watchdog.interval_s / 4:
            self._pinged_at = self.clock()
            self.watchdog.maybe_ping(self.notifier)

    def _view(self) -> View:
        agent_exit = None
        if self.agent is not None and not self._exit_seen:
            agent_exit = self.agent.exit_code()
        return View(
            now=self.clock(), phase=self.phase,
            agent_running=self.agent is not None and self.agent.running(),
            agent_exit=agent_exit, job_state=self.job_state,
            completed_seen_at=self.completed_seen_at, restart_at=self.restart_at,
            failures=tuple(self.failures), dead_peers=tuple(sorted(self.dead)),
            drain_reason=self.drain_reason,
        )

    def _update_metrics(self) -> None:
        m = self.metrics
        m.set_phase(self.phase)
        m.peers.set(len(self._known_peers))
        m.etcd_up.set(1 if self.membership.etcd_ok else 0)
        if self.progress:
            m.world_size.set(self.progress.get("world_size") or 0)
            m.step.set(self.progress.get("step") or 0)
        if self._published_step is not None:
            m.checkpoint_step.set(self._published_step)

    def _log_decision(self, decision: Decision) -> None:
        if decision.action is Action.NONE and decision.reason == self._last_reason:
            return
        self._last_reason = decision.reason
        self.notifier.status(self._status_line())
        self.log.info(decision.reason, action=decision.action.value, phase=decision.phase.value,
                      round=self.round, world_size=self.progress.get("world_size"),
                      step=self.progress.get("step"))

    # -- SIGHUP -------------------------------------------------------------------------

    def reload(self) -> None:
        """Re-read the config file; apply the reloadable sections, report the rest."""
        if self.config_path is None:
            self.log.warning("SIGHUP ignored: the daemon was not started from a config file")
            return
        try:
            new = load_config(self.config_path)
        except ElasticdError as exc:
            self.log.error("config reload rejected; keeping the running config", reason=str(exc))
            return
        applied, ignored = config_diff(self.config, new)
        kept = {name: getattr(self.config, name) for name in vars(self.config)
                if name not in RELOADABLE and name != "source"}
        self.config = dataclasses.replace(new, **kept)
        self.policy = _policy(self.config)
        if any(key.startswith("preemption.") for key in applied):
            self._start_preemption_watcher()
        self.notifier.reloading()
        self.log.info("config reloaded", applied=applied, needs_restart=ignored)
        self.notifier.ready()

    # -- reading the world -------------------------------------------------------------

    def _read_job_state(self) -> None:
        now = self.clock()
        if now - self._job_state_read_at < JOB_STATE_EVERY_S:
            return
        self._job_state_read_at = now
        drain_key = self.keys.drain(self.node_id)
        try:
            with no_retry():
                found, _ = self.client.get_many([self.keys.state, drain_key, self.keys.rdzv_state])
        except EtcdError:
            return
        rdzv = found.get(self.keys.rdzv_state)
        self.round = state_ops.view(rdzv.value).round if rdzv else None
        kv = found.get(self.keys.state)
        self.job_state = json.loads(kv.value).get("state") if kv else None
        if drain_key in found:
            reason = json.loads(found[drain_key].value).get("reason", "")
            self.request_drain(f"`elasticd drain` asked for it{': ' + reason if reason else ''}")
        if self.job_state == "completed" and self.completed_seen_at is None:
            self.completed_seen_at = now

    def _read_progress(self) -> None:
        try:
            mtime = self.files.progress.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._progress_mtime:
            return
        self._progress_mtime = mtime
        try:
            self.progress = json.loads(self.files.progress.read_text())
        except (OSError, ValueError):
            return  # caught mid-replace; the next cycle reads it
        step = self.progress.get("step")
        if self._step_at_start is None:
            self._step_at_start = step
        elif step is not None and step > self._step_at_start and self.failures:
            self.failures.clear()  # progress ends a crash loop
        self._publish_progress()

    def _publish_progress(self) -> None:
        now = self.clock()
        if now - self._status_sent_at >= 1.0:   # STATUS= at most once a second
            self._status_sent_at = now
            self.notifier.status(self._status_line())
        if now - self._checkpoint_read_at >= CHECKPOINT_EVERY_S or self.progress.get("event") in (
                "checkpoint", "stopped", "completed"):
            self._checkpoint_read_at = now
            self._publish_checkpoint()

    def _publish_checkpoint(self) -> None:
        """Hint /checkpoint/latest: the newest committed step in the (shared) checkpoint dir."""
        step = newest_committed_step(self.config.checkpoint.dir)
        if step is None or step == self._published_step:
            return
        self._published_step = step
        self._put_best_effort(self.keys.checkpoint_latest, {
            "step": step, "node": self.node_id, "dir": self.config.checkpoint.dir, "time": time.time()})

    def _status_line(self) -> str:
        p = self.progress
        return (f"{self.phase.value}: step {p.get('step', '-')}, world size "
                f"{p.get('world_size', '-')}, restarts {p.get('restart_count', '-')}")

    def _confirm_dead_peers(self) -> None:
        for peer in self.prober.take_refused():
            # Delete its key (fenced) so every daemon acts on the same etcd event.
            if self.membership.delete_peer(peer):
                self.log.info("peer refused its liveness probe; deleted its record", peer=peer.node_id)
        for peer in self.membership.take_departed():
            self._last_membership_change = self.clock()
            death = self._death(peer)
            if death is not None:
                self.dead[peer.node_id] = peer
                self._death_kind[peer.node_id] = death
        peers = frozenset(self.membership.peers())
        if peers - self._known_peers:
            self._last_membership_change = self.clock()
        self._known_peers = peers

    def _watch_workers(self) -> None:
        """Notice the agent restarting its workers, and tell a crash from a membership change."""
        if self.agent is None or not self.agent.running():
            self._workers = frozenset()
            return
        current = frozenset(p.pid for p in self.agent.workers(direct=True))
        if not current or current == self._workers:
            return
        restarted = bool(self._workers)
        self._workers = current
        if not restarted:
            return
        cause = restart_cause(self.clock(), self._last_membership_change, self.progress.get("event"))
        self.journal.record("workers-restarted", cause=cause)
        self.metrics.worker_restarts.labels(cause).inc()
        self.log.info(f"the agent restarted its workers after a {cause}", cause=cause)
        if cause == "crash":
            self.failures.append(self.clock())

    def _death(self, peer: Peer) -> str | None:
        """How a departed peer went: ``left``, ``crashed`` or ``silent``; None if it answers."""
        if peer.state in ("leaving", "completed", "failed"):
            return "left"
        endpoint = peer.record.get("probe")
        liveness = probe(endpoint, CONFIRM_TIMEOUT_S) if endpoint else Liveness.REFUSED
        if liveness is Liveness.ALIVE:
            self.log.info("peer record vanished but the peer answers; waiting for it to re-register",
                          peer=peer.node_id)
            return None
        return "crashed" if liveness is Liveness.REFUSED else "silent"

    def _kill_stuck_workers(self) -> None:
        """Kill, after KILL_GRACE_S, workers of the old world that did not fail by themselves."""
        if self._pending_kill is None or self.clock() < self._pending_kill[0]:
            return
        old = self._pending_kill[1]
        self._pending_kill = None
        stuck = [p for p in (self.agent.workers(direct=True) if self.agent else []) if p.pid in old]
        if stuck:
            proctree.kill_processes(stuck)
            self.log.info("killed workers still in the old world after the grace",
                          pids=[p.pid for p in stuck])

    def _leave_early_when_drained(self) -> None:
        """Draining: once our workers have exited, take our agent out of the rendezvous at
        once, so the others need not wait for the agent's own shutdown."""
        if self.phase is not Phase.DRAINING or self._left_rdzv or self.agent is None:
            return
        if not self.agent.workers(direct=True):
            self._left_rdzv = True
            self._leave_rendezvous()

    # -- acting ------------------------------------------------------------------------

    def _act(self, decision: Decision) -> None:
        handler = getattr(self, f"_do_{decision.action.value}", None)
        if handler is not None:
            handler(decision)

    def _do_start_agent(self, decision: Decision) -> None:
        self.files.stop.unlink(missing_ok=True)
        prune_log_dirs(self.files.torchrun_logs)
        command = torchrun_command(self.config, self.config.job.resolved_nproc(),
                                   self.files.torchrun_logs)
        self.agent = AgentProcess(command, worker_env(self.config, self.files), self.files.agent_log,
                                  clock=self.clock)
        pid = self.agent.start()
        self.metrics.agent_starts.inc()
        self._exit_seen = False
        self._step_at_start = self.progress.get("step")
        self.membership.update(state="running", agent_pid=pid)
        self.journal.record("agent-started", agent_pid=pid)
        if not self._ready_sent:
            self.notifier.ready()
            self._ready_sent = True

    def _do_evict_peers(self, decision: Decision) -> None:
        peers = [self.dead.pop(name) for name in decision.peers if name in self.dead]
        agents = {p.agent for p in peers if p.agent}
        try:
            removal = admin.evict_agents(self.client, self.keys, agents, self.config.job.min_nodes)
        except EtcdError as exc:
            self.log.warning("could not evict peers from the rendezvous; torch's keep-alive will",
                             reason=str(exc))
            removal = None
        was_running = any(p.state == "running" for p in peers)
        in_round = removal.in_round if removal and removal.removed else was_running
        self._last_membership_change = self.clock()
        killed = 0
        if in_round and self.agent is not None:
            if any(self._death_kind.pop(p.node_id, "") == "silent" for p in peers):
                killed = self.agent.kill_workers()
            else:
                workers = frozenset(p.pid for p in self.agent.workers(direct=True))
                self._pending_kill = (self.clock() + KILL_GRACE_S, workers)
        for peer in peers:
            self.journal.record("peer-lost", peer=peer.node_id, killed_workers=killed)
            self.metrics.evictions.inc()
        self.log.info("evicted lost peers", peers=[p.node_id for p in peers],
                      removed=list(removal.removed) if removal else [], killed_workers=killed)

    def _do_backoff(self, decision: Decision) -> None:
        self.failures.append(self.clock())
        self.restart_at = self.clock() + decision.delay_s
        self.membership.update(state="backoff", agent_pid=None)
        self.journal.record("agent-failed", exit_code=self.agent.exit_code() if self.agent else None)

    def _do_mark_failed(self, decision: Decision) -> None:
        if self.agent is not None and self.agent.running():
            self.agent.terminate(grace_s=5)
            self._leave_rendezvous()
        self.membership.update(state="failed", reason=decision.reason, agent_pid=None)
        self.journal.record("node-failed", reason=decision.reason)

    def _do_record_completed(self, decision: Decision) -> None:
        self._publish_checkpoint()
        self._put_best_effort(self.keys.state, {"state": "completed", "node": self.node_id,
                                                "time": time.time()})
        self.membership.update(state="completed", agent_pid=None)
        self.journal.record("job-completed", step=self.progress.get("step"))

    def _do_stop_completed(self, decision: Decision) -> None:
        self.agent.terminate(grace_s=10)

    def _do_drain(self, decision: Decision) -> None:
        self.membership.update(state="leaving")
        self.journal.record("node-draining", reason=self.drain_reason)
        self.notifier.stopping()
        self.files.stop.touch()
        if self.agent is not None and self.agent.running():
            grace = self.config.supervisor.drain_grace_s
            self._terminator = threading.Thread(target=self.agent.terminate, args=(grace,),
                                                name="elasticd-drain", daemon=True)
            self._terminator.start()

    def _do_finish_drain(self, decision: Decision) -> None:
        self._leave_rendezvous()
        self.journal.record("node-left", step=self.progress.get("step"))
        try:
            with no_retry():
                self.client.delete(self.keys.drain(self.node_id))
        except EtcdError:
            pass  # a stale request only drains this node again at its next start

    def _leave_rendezvous(self) -> None:
        if self.agent is None or self.agent.pid is None:
            return
        try:
            admin.evict_agents(self.client, self.keys, {(self.config.node.addr, self.agent.pid)},
                               self.config.job.min_nodes)
        except EtcdError as exc:
            self.log.warning("could not leave the rendezvous; peers evict us by keep-alive",
                             reason=str(exc))

    def _put_best_effort(self, key: str, value: dict[str, Any]) -> None:
        try:
            with no_retry():
                self.client.put(key, json.dumps(value).encode())
        except EtcdError as exc:
            self.log.warning("etcd write dropped", key=key, reason=str(exc))

    # -- shutdown ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        grace = 0.0 if self.hard_stop else 5.0
        if self.agent is not None and self.agent.running():
            self.agent.terminate(grace_s=grace)
            self._leave_rendezvous()
        left = proctree.kill_processes(proctree.descendants())
        if left:
            self.log.error("processes survived the daemon's shutdown", pids=[p.pid for p in left])
        self.prober.stop()
        self.probe_server.stop()
        if self.preemption is not None:
            self.preemption.stop()
        self.membership.leave()
        self.client.close()
        self.log.info("daemon stopped", phase=self.phase.value, hard=self.hard_stop)


def _policy(config: Config) -> Policy:
    sup = config.supervisor
    return Policy(sup.backoff_initial_s, sup.backoff_max_s, sup.crash_loop_failures,
                  sup.crash_loop_window_s)


def config_diff(old: Config, new: Config) -> tuple[dict[str, list], dict[str, list]]:
    """Changed keys as ``{"section.key": [old, new]}``: (reloadable, needs a restart)."""
    applied, ignored = {}, {}
    for section in (f.name for f in dataclasses.fields(old) if f.name != "source"):
        before, after = getattr(old, section), getattr(new, section)
        for f in dataclasses.fields(before):
            a, b = getattr(before, f.name), getattr(after, f.name)
            if a != b:
                shown = ["***", "***"] if f.name == "password" else [a, b]
                (applied if section in RELOADABLE else ignored)[f"{section}.{f.name}"] = shown
    return applied, ignored


def newest_committed_step(directory: str) -> int | None:
    """The newest committed checkpoint's step (manifests only, no tensors), or None."""
    from checkpointing import CheckpointError, CheckpointManager

    if not os.path.isdir(directory):
        return None
    try:
        return CheckpointManager(directory, read_only=True).latest_step()
    except CheckpointError:
        return None


def _devices() -> list[str]:
    """GPU names if torch sees CUDA here; never imports torch just to find out."""
    if "torch" not in __import__("sys").modules:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
