"""The node daemon's loop: observe, decide, act, log one line (if there is news).

A cycle, then ``TICK_S`` of sleep (the period is ``TICK_S`` plus the cycle's own time):

1. **observe**: membership news, probe news, the agent and its workers, the
   progress file, the job's keys in etcd, the background checkpoint scan, signals;
   into one immutable ``supervisor.Snapshot``. It decides nothing but is not
   read-only: a dirty node record is republished (``Membership.poll``), exited
   orphans are reaped, a checkpoint-like progress record wakes the scan thread;
2. **decide**: ``supervisor.decide(snapshot, memory, policy)``, pure, returns the
   next memory, the actions and one sentence;
3. **act**: each action through ``ACTIONS``, the table from ``Kind`` to its
   executor (checked complete at start); an executor decides nothing and logs nothing
   of its own: it returns an ``actions.Outcome`` where the line should say what it did;
4. **log** one line, the decision's sentence with its actions' outcomes
   (``cycle_sentence``; a quiet cycle logs nothing; tests assert on the sentences and the
   outcomes' fields), and beat the watchdog gate.

The whole cycle runs under one etcd deadline (``CYCLE_DEADLINE_S``): every etcd
call made from the loop is cut to the time left and fails fast after it, so an
etcd outage (even a frozen etcd that accepts connections and never answers)
delays membership changes only, never the loop and its watchdog pings. Anything
that failed is retried by a later cycle: a dirty node record is republished, a
refused peer is reported again by the next probe, a failed eviction is retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import structlog

from elasticd import __version__, proctree
from elasticd.actions import Action, Kind, Outcome
from elasticd.agent import (
    AgentProcess,
    etcd_auth,
    prune_log_dirs,
    torch_restart_count,
    torchrun_command,
    worker_env,
)
from elasticd.config import RELOADABLE, Config, check_secret_file, load_config
from elasticd.contract import generation
from elasticd.contract.progress import ProgressReader
from elasticd.contract.settings import IN_PLACE
from elasticd.errors import ElasticdError, EtcdError
from elasticd.etcd_client import EtcdClient, deadline
from elasticd.inplace.agreement import ShrinkOutcome, drain_world, grow_world, shrink_world
from elasticd.inplace.handover import hand_over
from elasticd.inplace.store import StoreHost
from elasticd.inplace.vetting import Roster, refusal
from elasticd.journal import Journal
from elasticd.membership import Membership
from elasticd.metrics import Metrics
from elasticd.observer import CheckpointScanner, JobReader, reap_orphans
from elasticd.preemption import Notice, PreemptionWatcher
from elasticd.prestart import Prestart, prepare
from elasticd.probe import Prober, ProbeServer
from elasticd.rendezvous import admin
from elasticd.rendezvous.entering import write_entry
from elasticd.rendezvous.keys import KEYED_ROUNDS, JobKeys
from elasticd.rendezvous.torch_compat import check_torch_apis
from elasticd.sdnotify import SystemdNotifier, WatchdogGate
from elasticd.supervisor import (
    Decision,
    Eviction,
    Memory,
    Phase,
    Policy,
    Snapshot,
    decide,
)
from elasticd.worker_errors import LastError

log = structlog.get_logger("elasticd.daemon")

TICK_S = 0.1
# The etcd budget of one cycle. A cycle that took at most twice this beats the watchdog gate.
CYCLE_DEADLINE_S = 1.5
# Budget of each rendezvous edit (eviction, leave, reopen) within the cycle's deadline.
RDZV_EDIT_S = 1.0
# Exit status of a node marked failed (crash loop): the unit's RestartPreventExitStatus
# lists it, so systemd does not restart a node whose script keeps crashing.
FAILED_EXIT_CODE = 3


class Daemon:
    def __init__(self, config: Config, *, config_path: str | None = None, clock=time.monotonic,
                 notifier: SystemdNotifier | None = None, early: Prestart | None = None) -> None:
        """``early``: the run files and warm host ``elasticd run`` made (and started) before
        it imported this module (``elasticd.prestart``); made here when None."""
        check_action_table()
        self.config = config
        self.config_path = config_path
        self.clock = clock
        self.keys = JobKeys(config.job.id, config.etcd.key_prefix)
        self.node_id = config.node.id
        self.early = early or prepare(config)
        # A temp run dir is kept at the end (its agent.log holds the workers' output, the
        # cause of a failure among it) and said so in the last line, never left silently.
        self._temp_run_dir = self.early.temp_run_dir
        self.files = self.early.files
        self.worker_errors = LastError(self.files.agent_log)
        self.policy = policy_from(config)
        self.metrics = Metrics()
        self.notifier = notifier or SystemdNotifier()
        self.watchdog = WatchdogGate.for_notifier(self.notifier, clock=clock)
        self.memory = Memory()
        self.agent: AgentProcess | None = None
        self.preemption: PreemptionWatcher | None = None
        self.progress = ProgressReader(self.files.progress)
        self._progress_seen = self.progress.progress
        self._restart_seen: tuple[frozenset[int], int | None] = (frozenset(), None)
        self._reload_requested = False
        self._stop_signals = 0
        self._drain_request: str | None = None
        self._notice_deadline: float | None = None
        self._eviction: Eviction | None = None
        self._shrink: ShrinkOutcome | None = None
        self._drained: ShrinkOutcome | None = None
        self._grown: ShrinkOutcome | None = None
        self.store_host = StoreHost(config.node.addr, config.recovery.store_port)
        self._refused: generation.GenerationId | None = None   # the last record vetting refused
        self.warm_host = self.early.warm_host
        self._status_at = float("-inf")
        self._checkpoint_seen: tuple[int | None, float] = (None, clock())
        self._stop = threading.Event()
        self.log = log.bind(job=config.job.id, node=self.node_id)

    # -- life cycle --------------------------------------------------------------------

    def _check_secret(self) -> None:
        """The job's secret file must be usable before any worker is handed its path; without
        one, say once what the groups then rest on."""
        check_secret_file(self.config.recovery)
        if not self.config.recovery.secret_file:
            self.log.info("in-place groups form unauthenticated (no [recovery] secret_file): "
                          "the recovery store's port must be reachable by the job's nodes only",
                          fix="docs/security.md: the job's secret")

    def run(self) -> int:
        """Run until the job completes, the node fails, or a drain finishes; the exit code."""
        check_torch_apis()
        self._check_secret()
        proctree.become_subreaper()
        self._install_signals()
        self._connect()
        try:
            while not self.memory.phase.final:
                self._cycle_guarded()
                time.sleep(TICK_S)
        finally:
            self._shutdown()
        if self.memory.phase is Phase.FAILED:
            return FAILED_EXIT_CODE
        return 1 if self.memory.life.hard_stop else 0

    def _connect(self) -> None:
        self.client = EtcdClient(self.config.etcd.settings(retry_s=30.0))
        self.probe_server = ProbeServer(self.config.node.addr).start()
        self.store_host.start()
        self.early.start_warm(self.config)   # (elasticd run started it before its imports)
        self.membership = Membership(self.client, self.keys, self.node_id,
                                     self.config.node.lease_ttl_s, self._initial_record(),
                                     clock=self.clock)
        self.membership.register()
        self.journal = Journal(self.client, self.keys, self.node_id)
        self.jobs = JobReader(self.client, self.keys, self.node_id, clock=self.clock)
        self.jobs.watch()
        self.scanner = CheckpointScanner(self.config.checkpoint.dir).start()
        self.prober = Prober(self.membership.peers, self.config.node.probe_interval_s,
                             me=self.node_id,
                             neighbours=self.config.node.probe_neighbours).start()
        with deadline(CYCLE_DEADLINE_S):
            self._record("node-joined")
        self._start_preemption_watcher()
        if self.config.metrics.port:
            self.metrics.serve(self.config.metrics.addr, self.config.metrics.port)
        if self.watchdog is not None:
            threading.Thread(target=self._ping_watchdog, name="elasticd-watchdog", daemon=True).start()
        self.log.info("registered in etcd; watching peers", probe=self.probe_server.endpoint,
                      run_dir=str(self.files.run_dir))

    def _start_preemption_watcher(self) -> None:
        if self.preemption is not None:
            self.preemption.stop()
            self.preemption = None
        if self.config.preemption.enabled:
            self.preemption = PreemptionWatcher(self.config.preemption, self._on_notice).start()

    def _on_notice(self, notice: Notice) -> None:
        if notice.deadline_s is not None:
            self._notice_deadline = self.clock() + notice.deadline_s
        left = f", {notice.deadline_s:.0f} s left" if notice.deadline_s is not None else ""
        self.request_drain(f"a {notice.provider} preemption notice arrived ({notice.reason}{left})")

    def _initial_record(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "addr": self.config.node.addr,
                "daemon_pid": os.getpid(), "probe": self.probe_server.endpoint,
                "store": self.store_host.endpoint,
                "version": __version__, "state": "starting", "devices": _devices()}

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "_reload_requested", True))

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        # Only a second *signal* is a hard stop: a notice or `elasticd drain` followed by
        # the shutdown's SIGTERM (GCE and Azure send both at once) keeps the drain going.
        self._stop_signals += 1
        self.request_drain(f"{signal.Signals(signum).name} was received")

    def request_drain(self, reason: str) -> None:
        if self._drain_request is None:
            self._drain_request = reason

    def _ping_watchdog(self) -> None:
        """WATCHDOG=1 while the loop beats: a stalled loop stops the pings, systemd restarts us."""
        period = self.watchdog.interval_s / 4
        while not self._stop.wait(period):
            self.watchdog.maybe_ping(self.notifier)

    # -- one cycle ---------------------------------------------------------------------

    def _cycle_guarded(self) -> None:
        """A cycle that raised (a bug) is logged and retried next tick, without a watchdog
        beat: training goes on, and a loop that keeps failing is restarted by systemd."""
        try:
            self.cycle()
        except Exception:
            self.log.exception("daemon cycle failed; retrying at the next tick")

    def cycle(self) -> Decision:
        started = self.clock()
        with deadline(CYCLE_DEADLINE_S, clock=self.clock):
            if self._reload_requested:
                self._reload_requested = False
                self.reload()
            snapshot = self.observe()
            decision = decide(snapshot, self.memory, self.policy)
            self.memory = decision.memory
            outcomes = [out for action in decision.actions
                        if (out := self._execute(action)) is not None]
        self._log(decision, snapshot, outcomes)
        if self.watchdog is not None and self.clock() - started <= 2 * CYCLE_DEADLINE_S:
            self.watchdog.beat()
        return decision

    def observe(self) -> Snapshot:
        """One read of everything the decision may look at."""
        self.membership.poll()
        reap_orphans(self.agent.pid if self.agent else None)
        job = self.jobs.read()
        drain = self._drain_request or job.drain_reason
        progress = self.progress.read()
        # Scan once per new record that says a checkpoint may have landed, not every cycle
        # while the file still holds it (the directory may be a slow NFS mount).
        if progress is not self._progress_seen and progress.event in ("checkpoint", "stopped",
                                                                       "completed"):
            self.scanner.poke()
        self._progress_seen = progress
        eviction, self._eviction = self._eviction, None
        shrink, self._shrink = self._shrink, None
        drained, self._drained = self._drained, None
        grown, self._grown = self._grown, None
        agent = self.agent
        workers = agent.workers(direct=True) if agent else []
        return Snapshot(
            now=self.clock(),
            agent_pid=agent.pid if agent else None,
            agent_exit=agent.exit_code() if agent else None,
            workers=frozenset(p.pid for p in workers),
            workers_restart_count=self._restart_count(workers),
            step=progress.step, progress_event=progress.event, progress_reason=progress.reason,
            worker_error=self.worker_errors.update(),
            job_state=job.job_state, drain_request=drain, notice_deadline=self._notice_deadline,
            stop_signals=self._stop_signals, rdzv_closed=job.rdzv_closed,
            round=job.round, round_members=job.round_members, agent_addr=self.config.node.addr,
            peers={n: p.view() for n, p in self.membership.peers().items()},
            refused=tuple(p.view() for p in self.prober.take_refused()),
            probe_answers=self.prober.take_answers(),
            departed=tuple(p.view() for p in self.membership.take_departed()),
            confirmations=self.prober.take_confirmations(),
            eviction=eviction, checkpoint_step=self.scanner.step,
            rank0_here=progress.rank == 0 and progress.event != "warm",   # (a newcomer's own rank)
            node_id=self.node_id, generation=progress.generation,
            world=progress.world(self.node_id), reform=progress.reform, shrink=shrink,
            drained=drained, grown=grown,
            generation_record=self._vetted(job.generation, progress.generation),
            **self._warm_server())

    def _warm_server(self) -> dict[str, Any]:
        host = self.warm_host
        if host is None or host.started_at is None:
            return {}
        return {"warm_server": host.state(), "warm_server_age_s": time.monotonic() - host.started_at}

    def _restart_count(self, workers: list[psutil.Process]) -> int | None:
        """torch's restart count of ``workers``, read once per worker group (/proc)."""
        pids = frozenset(p.pid for p in workers)
        if pids != self._restart_seen[0]:
            self._restart_seen = (pids, torch_restart_count(workers))
        return self._restart_seen[1] if pids else None

    def _execute(self, action: Action) -> Outcome | None:
        """Carry ``action`` out; its outcome, if the cycle's line should name it."""
        try:
            return ACTIONS[action.kind](self, action)
        except EtcdError as exc:
            # Every etcd write is retried by a later cycle (see the module docstring).
            self.log.warning("etcd call failed; a later cycle retries", action=action.kind.value,
                             reason=str(exc))
        except Exception:
            # A bug in one executor must not take the node's training down with the loop.
            self.log.exception("action failed", action=action.kind.value)
        return None

    def _log(self, decision: Decision, snapshot: Snapshot, outcomes: list[Outcome]) -> None:
        phase = decision.phase
        self.metrics.set_phase(phase)
        self.metrics.peers.set(len(snapshot.peers))
        self.metrics.etcd_up.set(1 if self.jobs.view.ok else 0)
        if snapshot.step is not None:
            self.metrics.step.set(snapshot.step)
        if self.progress.progress.world_size is not None:
            self.metrics.world_size.set(self.progress.progress.world_size)
        m = self.metrics
        if self.memory.life.intervals:
            m.steps_per_second.set(1.0 / max(statistics.median(self.memory.life.intervals), 1e-6))
        if self.jobs.view.round is not None:
            m.rendezvous_round.set(self.jobs.view.round)
        while self.jobs.round_trips:
            m.etcd_round_trip.observe(self.jobs.round_trips.pop())
        if snapshot.checkpoint_step != self._checkpoint_seen[0]:
            self._checkpoint_seen = (snapshot.checkpoint_step, self.clock())
        if snapshot.checkpoint_step is not None:
            m.checkpoint_age.set(self.clock() - self._checkpoint_seen[1])
        sentence = cycle_sentence(decision.reason, outcomes)
        if sentence:
            emit = self.log.warning if any(o.failed for o in outcomes) else self.log.info
            fields = {k: v for o in outcomes for k, v in o.fields.items()}
            emit(sentence, actions=[a.kind.value for a in decision.actions], phase=phase.value,
                 round=self.jobs.view.round, world_size=self.progress.progress.world_size,
                 step=snapshot.step, **fields)
        if sentence or self.clock() - self._status_at >= 1.0:  # with a sentence, else 1/s
            self._status_at = self.clock()
            self.notifier.status(self._status_line())

    def _status_line(self) -> str:
        p = self.progress.progress
        return (f"{self.memory.phase.value}: step {p.step if p.step is not None else '-'}, world size "
                f"{p.world_size or '-'}, restarts {p.restart_count if p.restart_count is not None else '-'}")

    # -- SIGHUP -------------------------------------------------------------------------

    def reload(self) -> None:
        """Re-read the config file; apply the reloadable sections, report the rest.

        Any failure keeps the running config: a bad file must never stop training.
        """
        if self.config_path is None:
            self.log.warning("SIGHUP ignored: the daemon was not started from a config file")
            return
        try:
            new = load_config(self.config_path)
            applied, ignored = config_diff(self.config, new)
            kept = {name: getattr(self.config, name) for name in vars(self.config)
                    if name not in RELOADABLE and name != "source"}
            config = dataclasses.replace(new, **kept)
            policy = policy_from(config)
        except (ElasticdError, TypeError, ValueError) as exc:
            self.log.error("config reload rejected; keeping the running config", reason=str(exc))
            return
        self.config, self.policy = config, policy
        if any(key.startswith("preemption.") for key in applied):
            self._start_preemption_watcher()
        self.notifier.reloading()
        self.log.info("config reloaded", applied=applied, needs_restart=ignored)
        self.notifier.ready()

    # -- the action table's executors -----------------------------------------------------

    def _start_agent(self, action: Action) -> Outcome:
        self.files.stop.unlink(missing_ok=True)
        self.files.leave.unlink(missing_ok=True)
        self.files.enter.unlink(missing_ok=True)
        if action.data.get("enter") is not None:   # a join in place: the next round is its own
            write_entry(self.files.enter, action["enter"])
        self.worker_errors.forget()   # a new life's failure names its own cause
        prune_log_dirs(self.files.torchrun_logs)
        warm = self.files.warm_socket if self.warm_host is not None else None
        command = torchrun_command(self.config, self.config.job.resolved_nproc(),
                                   self.files.torchrun_logs, warm)
        self.agent = AgentProcess(command, worker_env(self.config, self.files), self.files.agent_log,
                                  etcd_auth=etcd_auth(self.config), warm=self.warm_host)
        pid = self.agent.start()
        self.metrics.agent_starts.inc()
        self.membership.update(state="running", agent_pid=pid)
        how = "forked warm" if self.agent.started_warm else "cold"
        self._record("agent-started", agent_pid=pid, start=how)
        return Outcome(f"agent {pid} started ({how})", {"agent_pid": pid, "agent_start": how})

    def _terminate_agent(self, action: Action) -> None:
        """SIGTERM the agent and its workers (no wait: the drain's timer kills later)."""
        if self.agent is None or self.agent.pid is None:
            return
        for proc in self._tree(self.agent.pid):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)

    def _kill_agent(self, action: Action) -> Outcome | None:
        if self.agent is None or self.agent.pid is None:
            return None
        return _killed(f"agent {self.agent.pid}'s tree", proctree.kill_tree(self.agent.pid))

    def _kill_workers(self, action: Action) -> Outcome:
        procs = [p for pid in action["pids"] for p in self._tree(pid)]
        return _killed(f"{len(procs)} worker process(es)", proctree.kill_processes(procs))

    @staticmethod
    def _tree(pid: int) -> list[psutil.Process]:
        try:
            return [*proctree.descendants(pid), psutil.Process(pid)]
        except psutil.Error:
            return []

    def _confirm_peer(self, action: Action) -> None:
        self.prober.confirm(action["peer"].node_id, action["peer"].probe)

    def _evict(self, action: Action) -> Outcome:
        peers = action["peers"]
        names = tuple(p.node_id for p in peers)
        agents = {p.agent for p in peers if p.agent}
        if not agents:
            self._eviction = Eviction(names, ok=True, in_round=False)
            return Outcome(f"{', '.join(names)} had no agent to evict", {"evicted": list(names)})
        try:
            removal = admin.evict_agents(self.client, self.keys, agents, self.config.job.min_nodes,
                                         deadline_s=RDZV_EDIT_S)
        except EtcdError as exc:
            self._eviction = Eviction(names, ok=False)
            return Outcome(f"the eviction did not reach etcd ({exc}); retrying in a second",
                           {"evict_failed": list(names)}, failed=True)
        self._eviction = Eviction(names, ok=True,
                                  in_round=removal.in_round if removal.removed else None)
        removed = list(removal.removed)   # the rendezvous' names of the agents
        text = (f"evicted {', '.join(removed)} from the rendezvous" if removed
                else f"{', '.join(names)} already out of the rendezvous")
        return Outcome(text, {"evicted": list(names), "removed": removed})

    def _leave_rendezvous(self, action: Action | None = None) -> Outcome | None:
        if self.agent is None or self.agent.pid is None:
            return None
        try:
            admin.evict_agents(self.client, self.keys, {(self.config.node.addr, self.agent.pid)},
                               self.config.job.min_nodes, deadline_s=RDZV_EDIT_S)
        except EtcdError as exc:
            return Outcome(f"could not leave the rendezvous ({exc}); the peers evict us by "
                           "keep-alive", failed=True)
        return None

    def _shrink_world(self, action: Action) -> Outcome:
        """Agree the next in-place generation, hand it to our workers, and (if this
        daemon's write made it) release the old round's exit barrier."""
        lost = action["lost"]
        out = self._agreement(lost, lambda: shrink_world(
            self.client, self.keys, self.node_id, lost, action["cause"], action["generation"],
            self._world_views(action["peers"]), self._roster(), deadline_s=RDZV_EDIT_S,
            spares=action["spares"]))
        self._shrink = out
        if out.status == "failed":
            return Outcome(f"no in-place generation: {out.reason}", _generation_fields(out),
                           failed=True)
        verb = "agreed" if out.wrote else "adopted"
        gid = out.record.id
        text = {"ok": f"generation {gid} {verb}", "fenced": f"generation {gid} {verb} without us",
                "unneeded": f"generation {gid} already leaves them out"}[out.status]
        return self._released(out, text)

    def _drain_in_place(self, action: Action) -> Outcome:
        """Agree the planned generation without this node and hand it to our workers (they
        stop after the step the world agrees, the others re-form); the leave file keeps our
        agent out of every later round, so the others' agents see nobody waiting."""
        try:
            out = drain_world(self.client, self.keys, self.node_id, action["generation"],
                              self._world_views(()), self._roster(), deadline_s=RDZV_EDIT_S)
        except EtcdError as exc:
            out = ShrinkOutcome((self.node_id,), "failed", reason=f"etcd did not answer: {exc}")
        if out.status == "ok":
            try:
                self.files.leave.touch()   # before our workers can stop and the agent rejoin
                out = self._hand_over(out)
            except OSError as exc:
                out = dataclasses.replace(out, status="failed",
                                          reason=f"the leave file was not written: {exc}")
        self._drained = out
        if out.status == "failed":
            return Outcome(f"no drain in place: {out.reason}", _generation_fields(out), failed=True)
        verb = "agreed" if out.wrote else "adopted"
        return self._released(out, f"generation {out.record.id} {verb} without this node; our "
                                   "workers stop after the step the world agrees")

    def _grow_in_place(self, action: Action) -> Outcome:
        """Agree the planned generation with this node (our newcomers are warm) and hand
        it to them; the members' daemons adopt it and their workers re-form after the
        step their world agrees."""
        # How many workers torch started here (the warm record says), else the config's.
        nproc = self.progress.progress.local_world_size or self.config.job.resolved_nproc()
        others = dict(action["others"])   # warm newcomers of other nodes: one generation
        out = self._agreement((self.node_id, *others), lambda: grow_world(
            self.client, self.keys, self.node_id, nproc, action["live"], self._world_views(()),
            self._roster(joining=action["live"]), deadline_s=RDZV_EDIT_S, others=others))
        self._grown = out
        if out.status == "failed":
            return Outcome(f"no join in place: {out.reason}", _generation_fields(out), failed=True)
        verb = "agreed" if out.wrote else "adopted"
        return Outcome(f"generation {out.record.id} {verb} with this node; our workers enter "
                       "it after the step the world agrees", _generation_fields(out))

    def _agreement(self, nodes: tuple[str, ...], agree: Callable[[], ShrinkOutcome]) -> ShrinkOutcome:
        """One agreement's outcome (a failed one when etcd does not answer), handed to our
        workers when it names a record for them."""
        try:
            out = agree()
        except EtcdError as exc:
            return ShrinkOutcome(tuple(nodes), "failed", reason=f"etcd did not answer: {exc}")
        return self._hand_over(out) if out.status == "ok" else out

    def _released(self, out: ShrinkOutcome, text: str) -> Outcome:
        """``text``'s outcome, once the old round's exit barrier is released if this
        daemon's write made a generation that leaves a node of that round out."""
        fields = _generation_fields(out)
        if out.wrote and out.status in ("ok", "fenced") and not self._release_exit_barrier(out.record):
            return Outcome(f"{text}; the old round's exit barrier was not released (the survivors "
                           "wait torch's exit-barrier timeout at the job's end)", fields, failed=True)
        return Outcome(text, fields)

    def _hand_over(self, out: ShrinkOutcome) -> ShrinkOutcome:
        try:
            hand_over(str(self.files.generation), out.record)
        except OSError as exc:
            return dataclasses.replace(out, status="failed",
                                       reason=f"the generation file was not written: {exc}")
        self.store_host.prune(out.record.id)
        return out

    def _world_views(self, dead: tuple) -> list[generation.WorldView]:
        """One view per node: the dead peers' last, the live peers', ours last (freshest)."""
        views = {p.node_id: p.world for p in dead if p.world is not None}
        views.update({n: p.world for n, p in self.membership.peers().items() if p.world})
        mine = self.progress.progress.world(self.node_id)
        if mine is not None:
            views[self.node_id] = mine
        return list(views.values())

    def _roster(self, joining: generation.GenerationId | None = None) -> Roster:
        """What the live nodes' records say of themselves, ours from the source (vetting);
        ``joining``: the live world our newcomers wait to enter, when the caller knows it."""
        peers = self.membership.peers()
        stores = {n: p.store for n, p in peers.items() if p.store}
        worlds = {n: p.world.generation for n, p in peers.items() if p.world is not None}
        entering = {n: p.entering.live for n, p in peers.items() if p.entering is not None}
        if self.store_host.endpoint is not None:
            stores[self.node_id] = self.store_host.endpoint
        mine = self.progress.progress.world(self.node_id)
        if mine is not None:
            worlds[self.node_id] = mine.generation
        joining = joining or self.memory.life.joining
        if joining is not None:
            entering[self.node_id] = joining
        return Roster(stores, worlds, entering)

    def _vetted(self, record: generation.GenerationRecord | None,
                workers: generation.GenerationId | None) -> generation.GenerationRecord | None:
        """The agreed record, unless it is newer than our workers' and the nodes' records
        do not bear it out (``vetting``): then no decision sees it (said once per record)."""
        if record is None or workers is None or not record.id.newer_than(workers):
            return record
        why = refusal(record, self._roster())
        if why is None:
            return record
        if record.id != self._refused:
            self._refused = record.id
            self.log.warning("not handing our workers an agreed generation that the nodes' "
                             "records do not bear out", generation=str(record.id), problem=why,
                             fix="if no daemon wrote it, see docs/security.md (who can write "
                                 "the job's etcd prefix)")
        return None

    def _release_exit_barrier(self, record: generation.GenerationRecord) -> bool:
        """Whether the old round's exit barrier was released."""
        try:
            admin.release_exit_barrier(self.client, self.keys, record.id.round,
                                       deadline_s=RDZV_EDIT_S)
        except EtcdError:
            return False
        return True

    def _write_generation(self, action: Action) -> None:
        hand_over(str(self.files.generation), action["record"])
        self.store_host.prune(action["record"].id)

    def _reopen_rendezvous(self, action: Action) -> Outcome:
        reopened = admin.reopen_if_closed(self.client, self.keys, deadline_s=RDZV_EDIT_S)
        return Outcome("reopened" if reopened else "another daemon reopened it first")

    def _publish(self, action: Action) -> None:
        self.membership.update(**action["fields"])

    def _journal(self, action: Action) -> None:
        self._record(action["event"], **action["fields"])

    def _record(self, event: str, **fields: Any) -> None:
        # Every entry carries where training stood, so a timeline can be drawn from the journal.
        p = self.progress.progress
        self.journal.record(event, **{"step": p.step, "world_size": p.world_size,
                                      "round": self.jobs.view.round, **fields})

    def _count(self, action: Action) -> None:
        metric = getattr(self.metrics, action["metric"])
        metric.labels(action["label"]).inc()

    def _observe(self, action: Action) -> None:
        metric = getattr(self.metrics, action["metric"])
        metric.labels(action["label"]).observe(action["value"])

    def _mark_completed(self, action: Action) -> None:
        self._put(self.keys.state, {"state": "completed", "node": self.node_id, "time": time.time()})

    def _publish_checkpoint(self, action: Action) -> None:
        step = action["step"]
        self.metrics.checkpoint_step.set(step)
        self._put(self.keys.checkpoint_latest, {"step": step, "node": self.node_id,
                                                "dir": self.config.checkpoint.dir, "time": time.time()})

    def _touch_stop_file(self, action: Action) -> None:
        self.files.stop.touch()

    def _delete_drain_key(self, action: Action) -> None:
        self.client.delete(self.keys.drain(self.node_id))

    def _notify(self, action: Action) -> None:
        {"ready": self.notifier.ready, "stopping": self.notifier.stopping}[action["what"]]()

    def _put(self, key: str, value: dict[str, Any]) -> None:
        self.client.put(key, json.dumps(value).encode())

    # -- shutdown ----------------------------------------------------------------------

    def _shutdown(self) -> None:
        self._stop.set()
        grace = 0.0 if self.memory.life.hard_stop else 5.0
        if self.agent is not None and self.agent.running():
            self.agent.terminate(grace_s=grace)
            with deadline(CYCLE_DEADLINE_S):
                self._leave_rendezvous()
        left = proctree.kill_processes(proctree.descendants())
        if left:
            self.log.error("processes survived the daemon's shutdown", pids=[p.pid for p in left])
        self.prober.stop()
        self.jobs.unwatch()
        self.scanner.stop()
        self.probe_server.stop()
        self.store_host.stop()
        if self.warm_host is not None:
            self.warm_host.stop()
        if self.preemption is not None:
            self.preemption.stop()
        with deadline(CYCLE_DEADLINE_S):
            self.membership.leave()
        self.client.close()
        self.log.info("daemon stopped", phase=self.memory.phase.value, hard=self.memory.life.hard_stop,
                      **self.last_words())

    def last_words(self) -> dict[str, str]:
        """The last line's notes: a run dir this daemon made up, and after a completed job
        how to start the next run (``next_run_hint``)."""
        notes = self.run_dir_note()
        if self.memory.phase is Phase.COMPLETED:
            notes["next_run"] = next_run_hint(self.config)
        return notes

    def run_dir_note(self) -> dict[str, str]:
        """What the last line says about a run dir this daemon made up (none if configured)."""
        if not self._temp_run_dir:
            return {}
        return {"run_dir_kept": str(self.files.run_dir),
                "note": "agent.log there holds the workers' output; delete the directory when "
                        "done, or set [node] run_dir to choose where it goes"}


def next_run_hint(config: Config) -> str:
    """How to start another run once this job completed: what the code requires.

    ``/state`` says completed for good, and a daemon that reads it stops at once (the
    ``_job_completed`` rule: "nothing left to run"), so the next run needs a job id with no
    keys in etcd: a new one, or this one with its keys deleted (every daemon stopped). The
    checkpoints carry no job id: the trainer's workers resume from the newest one in the
    checkpoint directory, so a run from step 0 needs another (or an emptied) directory.
    """
    keys = JobKeys(config.job.id, config.etcd.key_prefix)
    endpoints = ",".join(config.etcd.endpoints)
    return (f"job {config.job.id!r} is complete and stays so ({keys.state} says completed; a "
            f"daemon started with this job id again stops at once). To start the next run, give "
            f"it a new [job] id (or ELASTICD_JOB_ID), or reuse this one after deleting its keys "
            f"with every daemon stopped: etcdctl --endpoints={endpoints} del --prefix "
            f"{keys.prefix} (with your etcd TLS and auth flags). Either way its workers resume "
            f"from the newest checkpoint in {config.checkpoint.dir}: to train from step 0, point "
            f"[checkpoint] dir (or ELASTICD_CHECKPOINT_DIR) at an empty directory "
            f"(deploy/README.md, 'The next run')")


def _generation_fields(out: ShrinkOutcome) -> dict[str, Any]:
    return {"generation_status": out.status,
            "generation": str(out.record.id) if out.record else None}


def cycle_sentence(reason: str, outcomes: list[Outcome]) -> str:
    """The cycle's one log line: why (the decision), then what the actions did.

    ``"peer(s) b lost; evicting them ... in place (evicted 10.0.0.2_77_0 from the rendezvous;
    generation 4.1 agreed)"``. A cycle with no reason names its outcomes alone (an action's failure)."""
    done = "; ".join(o.text for o in outcomes)
    if not reason:
        return done
    return f"{reason} ({done})" if done else reason


def _killed(what: str, survivors: list[psutil.Process]) -> Outcome:
    if not survivors:
        return Outcome(f"killed {what}")
    return Outcome(f"killed {what}; {len(survivors)} still alive after SIGKILL",
                   {"kill_survivors": [p.pid for p in survivors]}, failed=True)


ACTIONS: dict[Kind, Callable[[Daemon, Action], Outcome | None]] = {
    Kind.START_AGENT: Daemon._start_agent,
    Kind.TERMINATE_AGENT: Daemon._terminate_agent,
    Kind.KILL_AGENT: Daemon._kill_agent,
    Kind.KILL_WORKERS: Daemon._kill_workers,
    Kind.CONFIRM_PEER: Daemon._confirm_peer,
    Kind.EVICT: Daemon._evict,
    Kind.LEAVE_RENDEZVOUS: Daemon._leave_rendezvous,
    Kind.REOPEN_RENDEZVOUS: Daemon._reopen_rendezvous,
    Kind.PUBLISH: Daemon._publish,
    Kind.JOURNAL: Daemon._journal,
    Kind.COUNT: Daemon._count,
    Kind.OBSERVE: Daemon._observe,
    Kind.MARK_COMPLETED: Daemon._mark_completed,
    Kind.PUBLISH_CHECKPOINT: Daemon._publish_checkpoint,
    Kind.TOUCH_STOP_FILE: Daemon._touch_stop_file,
    Kind.DELETE_DRAIN_KEY: Daemon._delete_drain_key,
    Kind.NOTIFY: Daemon._notify,
    Kind.SHRINK: Daemon._shrink_world,
    Kind.WRITE_GENERATION: Daemon._write_generation,
    Kind.DRAIN_IN_PLACE: Daemon._drain_in_place,
    Kind.GROW_IN_PLACE: Daemon._grow_in_place,
}


def check_action_table(table: dict[Kind, Callable] = ACTIONS) -> None:
    """Every ``Kind`` the decisions can return has an executor (checked at start)."""
    missing = sorted(k.value for k in Kind if k not in table)
    if missing:
        raise RuntimeError(f"elasticd bug: no executor for action(s) {missing} in daemon.ACTIONS")


def policy_from(config: Config) -> Policy:
    sup = config.supervisor
    return Policy(
        backoff_initial_s=sup.backoff_initial_s, backoff_max_s=sup.backoff_max_s,
        crash_loop_failures=sup.crash_loop_failures, crash_loop_window_s=sup.crash_loop_window_s,
        drain_grace_s=sup.drain_grace_s, hang_timeout_s=sup.hang_timeout_s,
        hang_floor_s=sup.hang_floor_s, hang_factor=sup.hang_factor,
        start_timeout_s=sup.start_timeout_s, broken_round_grace_s=sup.broken_round_grace_s,
        release_broken_rounds=sup.release_broken_rounds,
        recovery_mode=config.recovery.mode,
        recovery_bound_s=config.recovery.bound_s,
        silent_suspect_s=float(config.node.lease_ttl_s),
        join_in_place=(config.recovery.join_in_place and config.recovery.mode == IN_PLACE
                       and config.rendezvous.rounds == KEYED_ROUNDS),
        max_nodes=config.job.max_nodes, nproc=config.job.resolved_nproc())


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


def _devices() -> list[str]:
    """GPU names if torch sees CUDA here. The daemon has imported torch by now
    (``observer`` imports torch's rendezvous through ``rendezvous.state_ops`` and
    ``rounds``; ``Daemon.run`` checks torch's APIs before it connects), so this
    costs no import; the guard keeps the function from ever being the one that imports it."""
    if "torch" not in __import__("sys").modules:
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
