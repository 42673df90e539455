"""One packed process of the scale harness (``benchmarks/scale.py``): many simulated nodes.

A simulated node is what one machine of a job runs, minus the training processes, all
of it the project's (and torch's) own code:

* ``elasticd``: a real ``elasticd.daemon.Daemon`` (membership on its lease, the
  prober and probe server, the supervisor's decisions, eviction, the journal, the job
  reader, its recovery store host) running its own loop in a thread, on its own
  loopback address (127.x.y.z, so every node has its own probe port and torch node
  identity). Its torchrun agent is torch's own ``SimpleElasticAgent`` loop, built from
  the exact command line the daemon starts (``agent.torchrun_command``, parsed by
  torchrun's ``parse_args``/``config_from_args``; the handler from torch's registry,
  i.e. the plugin's factory), with stand-in workers instead of processes;
* ``etcd3`` / ``etcd3-poll`` / ``c10d``: that agent alone, from a torchrun command line the harness
  gives (plain torchrun on the etcd3 plugin, or on torch's c10d store).

What is not simulated (node-local, no cross-node cost): worker processes (stand-ins
that report their world and fail on command), the daemon's orphan reaping (it scans
/proc, which here holds every simulated node's process), the progress file (absent),
checkpoint scans (an empty directory).

Protocol: the first stdin line is the JSON spec; the process answers ``ready`` on its
protocol fd (the original stdout; fd 1 is pointed at stderr, so logs never mix with it),
then reads commands, one JSON object a line: ``go`` (start the nodes), ``fail`` (every
stand-in worker fails, as gloo fails them when a peer dies), ``counters`` (cumulative
probe and etcd-call counts). Events: ``world`` (a node's agent started workers in a
world), ``error``, ``counters``.
"""

from __future__ import annotations

import collections
import faulthandler
import itertools
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Stand-in worker ids: above any pid this kernel hands out (pid_max <= 2**22), so the
# daemon's psutil lookups of them find nothing real to signal.
_WORKER_IDS = itertools.count(10**8)
_out_lock = threading.Lock()
_out: Any = None   # the protocol stream (the original stdout)
_NODE_OF_ADDR: dict[str, str] = {}   # a simulated node's address -> its id


def emit(**event: Any) -> None:
    line = json.dumps(event, default=str) + "\n"
    with _out_lock:
        _out.write(line)
        _out.flush()


# -- counters (harness-side instrumentation of the real code) ----------------------------

_COUNTED_CALLS = ("get", "get_prefix", "list_prefix", "get_many", "put", "put_or_create",
                  "delete", "delete_if_revision", "grant_lease", "refresh_lease", "lease_ttl",
                  "revoke_lease", "wait_for_change", "watch_prefix", "count_prefix",
                  "first_created", "create_all")
# Threads that act for the daemon (its loop, its node lease); everything else in the
# process that calls etcd is the rendezvous (agent thread, torch's keep-alive timer,
# the run lease).
_DAEMON_THREADS = ("sim-daemon", "elasticd-node")
_calls: collections.Counter = collections.Counter()
_probes: collections.Counter = collections.Counter()
_count_lock = threading.Lock()


def _role() -> str:
    return "daemon" if threading.current_thread().name.startswith(_DAEMON_THREADS) else "rendezvous"


def count_etcd_calls() -> None:
    """Count every call of the adapter by (role, method): the clients' view of the load."""
    from elasticd.etcd_client import EtcdClient

    def counted(name: str, original: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            with _count_lock:
                _calls[f"{_role()}.{name}"] += 1
            return original(self, *args, **kwargs)
        return call

    for name in _COUNTED_CALLS:
        setattr(EtcdClient, name, counted(name, getattr(EtcdClient, name)))


def count_probes() -> None:
    """Count the prober's probes by outcome (``Prober`` looks ``probe`` up at each call)."""
    from elasticd import probe as probe_module

    original = probe_module.probe

    def counted(endpoint: str, timeout_s: float = 1.0) -> Any:
        answer = original(endpoint, timeout_s)
        with _count_lock:
            _probes[answer.value] += 1
        return answer

    probe_module.probe = counted


def counters() -> dict[str, Any]:
    with _count_lock:
        return {"calls": dict(_calls), "probes": dict(_probes)}


# -- the agent: torch's loop with stand-in workers ------------------------------------------

def build_agent(command: list[str], node_id: str) -> Any:
    """torch's ``SimpleElasticAgent`` for ``command`` (a torchrun command line), as
    ``torch.distributed.launcher.api.launch_agent`` builds its agent, workers aside."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import (
        RunResult,
        SimpleElasticAgent,
        WorkerSpec,
        WorkerState,
    )
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    start = command.index("torch.distributed.run") + 1
    config, entrypoint, args = torchrun.config_from_args(torchrun.parse_args(command[start:]))
    params = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    spec = WorkerSpec(role=config.role, local_world_size=config.nproc_per_node,
                      entrypoint=entrypoint, args=tuple(args),
                      rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
                      max_restarts=config.max_restarts, monitor_interval=config.monitor_interval,
                      local_addr=config.local_addr)

    class StandInAgent(SimpleElasticAgent):
        """Workers that exist only as ids: they report their world and fail on command."""

        def __init__(self) -> None:
            super().__init__(spec)
            self.failed = threading.Event()
            self.worker_ids: tuple[int, ...] = ()

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            ids = {w.local_rank: next(_WORKER_IDS) for w in worker_group.workers}
            self.worker_ids = tuple(ids.values())
            self.failed.clear()
            emit(ev="world", node=node_id, t=time.time(), rank=worker_group.group_rank,
                 world_size=worker_group.group_world_size, round=_round_of(spec.rdzv_handler))
            return ids

        def _stop_workers(self, worker_group: Any) -> None:
            self.worker_ids = ()

        def _monitor_workers(self, worker_group: Any) -> Any:
            return RunResult(state=WorkerState.FAILED if self.failed.is_set() else WorkerState.HEALTHY)

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            pass

    return StandInAgent()


def _round_of(handler: Any) -> int | None:
    """The round of the world just formed, for either rendezvous handler."""
    world = getattr(handler, "world", None)          # keyed rounds
    if world is not None:
        return world.round
    holder = getattr(handler, "_state_holder", None)  # torch's dynamic rendezvous
    return getattr(getattr(holder, "state", None), "round", None)


class StandInAgentProcess:
    """The daemon's view of its agent (``elasticd.agent.AgentProcess``'s interface), run
    as a thread of this process. ``pid`` is this process's: torch's node identity in
    the rendezvous is (addr, pid, local id), so (node addr, pid) names this node's agent
    for the daemon's eviction exactly as it does for a real agent."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None,
                 log_path: Path | None = None, clock: object = None, *,
                 etcd_auth: object = None, node_id: str = "", **_: Any) -> None:
        self._command = command
        addr = _local_addr(command)
        self.node_id = node_id or _NODE_OF_ADDR.get(addr, addr)
        self.agent: Any = None
        self._exit: int | None = None
        self._started = False

    def start(self) -> int:
        self._started = True
        threading.Thread(target=self._run, name=f"sim-agent-{self.node_id}", daemon=True).start()
        return os.getpid()

    def _run(self) -> None:
        try:
            # Built on the agent's thread, as torchrun builds it in its own process: the
            # daemon's cycle deadline does not apply to the handler's first etcd calls.
            self.agent = build_agent(self._command, self.node_id)
            self.agent.run()
            self._exit = 0
        except BaseException as exc:   # the agent's death is an event, not this process's
            emit(ev="error", node=self.node_id, error=f"{type(exc).__name__}: {exc}",
                 trace=traceback.format_exc()[-2000:])
            self._exit = 1

    @property
    def pid(self) -> int | None:
        return os.getpid() if self._started else None

    def exit_code(self) -> int | None:
        return self._exit

    def running(self) -> bool:
        return self._started and self._exit is None

    def workers(self, direct: bool = False) -> list[Any]:
        ids = self.agent.worker_ids if self.agent is not None else ()
        return [SimpleNamespace(pid=i) for i in ids]

    def fail_workers(self, ids: Any = None) -> None:
        """Fail the current workers (all, or only if ``ids`` names current ones)."""
        agent = self.agent
        if agent is not None and (ids is None or set(ids) & set(agent.worker_ids)):
            agent.failed.set()

    def terminate(self, grace_s: float = 0.0) -> int | None:
        self.fail_workers()
        return self._exit


def _local_addr(command: list[str]) -> str:
    return next((a.split("=", 1)[1] for a in command if a.startswith("--local-addr=")), "?")


# -- the daemon -------------------------------------------------------------------------------

def node_config(spec: dict[str, Any], node: dict[str, str]) -> Any:
    """The elasticd config of one simulated node (defaults but for the job and its files)."""
    from elasticd.config import config_from_dict

    return config_from_dict({
        "job": {"id": spec["job"], "entrypoint": ["train.py"], "min_nodes": spec["min_nodes"],
                "max_nodes": spec["max_nodes"], "warm_start": False},
        "etcd": {"endpoints": [spec["etcd"]]},
        "node": {"id": node["id"], "addr": node["addr"],
                 "run_dir": str(Path(spec["run_dir"]) / node["id"])},
        "checkpoint": {"dir": str(Path(spec["run_dir"]) / "checkpoints")},
        # The restart path: survivors re-rendezvous, which is what this harness measures.
        "recovery": {"mode": "restart"},
        "rendezvous": {"rounds": spec.get("rounds", "torch")},
    })


def start_daemon(spec: dict[str, Any], node: dict[str, str]) -> Any:
    """A real ``Daemon`` for one simulated node, its loop running in a thread."""
    from elasticd import daemon as daemon_module
    from elasticd.actions import Kind

    class SimDaemon(daemon_module.Daemon):
        """The daemon with the executors that signal processes pointed at the stand-in
        agent (a real one would signal this whole packed process)."""

        def _execute(self, action: Any) -> None:
            if action.kind is Kind.KILL_WORKERS:
                if self.agent is not None:
                    self.agent.fail_workers(action["pids"])
            elif action.kind in (Kind.KILL_AGENT, Kind.TERMINATE_AGENT):
                if self.agent is not None:
                    self.agent.terminate()
            else:
                super()._execute(action)

    daemon = SimDaemon(node_config(spec, node))
    thread = threading.Thread(target=_run_daemon, args=(daemon,), name=f"sim-daemon-{node['id']}",
                              daemon=True)
    thread.start()
    return daemon


def _run_daemon(daemon: Any) -> None:
    try:
        daemon.run()
    except BaseException as exc:
        emit(ev="error", node=daemon.node_id, error=f"{type(exc).__name__}: {exc}",
             trace=traceback.format_exc()[-2000:])


def patch_node_local_parts() -> None:
    """Point the daemon's process-level parts at the stand-ins (see the module docstring),
    and give torch's rendezvous event names a cheaper frame lookup."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

    from elasticd import daemon as daemon_module

    daemon_module.AgentProcess = StandInAgentProcess
    daemon_module.reap_orphans = lambda keep: []
    # torch names each rendezvous event after its caller with inspect.stack(), twice:
    # that reads the source file of every frame of the thread's stack (~1/3 of a packed
    # process's CPU at N=32 in py-spy). On a real node that is its own CPU; packed, it
    # starves every other node of the process. Same name, from the frame itself.
    dyn.get_method_name = _caller_name


def _caller_name(depth: int = 2) -> str:
    """``dynamic_rendezvous.get_method_name``'s answer without ``inspect.stack()``."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


# -- the process ------------------------------------------------------------------------------

def main() -> None:
    global _out
    _out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                      # print()/structlog to stdout land in the log
    sys.stdout = os.fdopen(1, "w", buffering=1)
    # SIGUSR1 dumps every thread's stack into the log: how a stuck cell is diagnosed.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(sys.stdin.readline())
    _NODE_OF_ADDR.update({node["addr"]: node["id"] for node in spec["nodes"]})

    from elasticd.logs import configure_logging
    configure_logging(spec.get("log_level", "INFO"), json=True)
    count_etcd_calls()
    count_probes()
    patch_node_local_parts()
    import torch.distributed.run  # noqa: F401  (imported before "ready": not in the timings)

    from elasticd.rendezvous import handler
    if spec.get("torch_poll"):
        # torch's own 1 s poll between syncs while a round forms (what handler.py replaces).
        handler.dyn._delay = handler._TORCH_DELAY
    emit(ev="ready", pid=os.getpid(), nodes=len(spec["nodes"]))
    handles: dict[str, Any] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        what = cmd["cmd"]
        if what == "go":
            for node in spec["nodes"]:
                if spec["system"].startswith("elasticd"):
                    handles[node["id"]] = start_daemon(spec, node)
                else:
                    agent = StandInAgentProcess(node["command"], node_id=node["id"])
                    agent.start()
                    handles[node["id"]] = SimpleNamespace(agent=agent)
        elif what == "fail":
            for handle in handles.values():
                if handle.agent is not None:
                    handle.agent.fail_workers()
        elif what == "counters":
            emit(ev="counters", seq=cmd.get("seq"), t=time.time(), **counters())
    # stdin closed: the harness is gone; so are we (SIGKILL usually comes first).
    os._exit(0)


if __name__ == "__main__":
    main()
