"""Scale harness: N simulated nodes against one real etcd (issue 14, part 1).

    python -m benchmarks.scale --nodes 8,32,128,256 --out benchmarks/results/scale

For each N and each system, a fresh etcd (or c10d store) and N simulated nodes packed
into ``--procs`` processes (``benchmarks/scale_node.py``: the real daemon and torch's
agent loop on the real handler, stand-in workers), plus one more process holding the
node that is killed. Systems:

    elasticd  a real Daemon per node (membership, probes, eviction, journal) with its
              torchrun agent on the etcd3 plugin, the command line the daemon builds
    etcd3     the same agents without daemons (plain torchrun on the plugin)
    etcd3-poll  the same with torch's own 1 s poll while a round forms, instead of the
              plugin's watch-woken poll (handler.py): what that change does at scale
    c10d      the agents on torch's c10d rendezvous, tuned as in benchmarks/mttr.py
              (last_call 1 s, keep-alive 1 s x 2, monitor 0.1 s), the store in its own
              process (a dedicated store host: no node's crash takes it down here)

Measured per cell:

* form: from "go" (every process imported and waiting) until every node's agent has
  started workers in one world of N (torch's rank assignment done); ``first_world_s``
  is the first world of any size;
* steady state (``--steady-s`` after ``--settle-s``): etcd requests (the server's own
  ``grpc_server_msg_received_total``: unary calls plus stream messages such as lease
  keep-alives and watch creations) and bytes (``etcd_network_client_grpc_*_bytes_total``)
  per node per second, the clients' own count of adapter calls by role and method,
  probes per daemon per second, CPU per node (the packed processes' CPU time / N);
* re-form: the victim's process is SIGKILLed (its probe port, leases and agent die
  with it); 0.1 s later every survivor's stand-in workers fail, as gloo fails workers
  whose peer died; until every survivor's agent has started workers in a world of N-1.
  The same rates over that window.

Every wait has a cap (``--form-timeout-s``, ``--reform-timeout-s``): a cell that does not
form says so. Every process started is killed at the end of its cell, and the harness
checks with psutil that none is left. Results: NAME.json, NAME.md and NAME-<figure>.png
(each figure against N, log-x), and a power-law fit of each figure over N extrapolated to
2,048 nodes (the projection in docs/scale.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.mttr import TUNED_CONF, loadavg, machine
from benchmarks.scale_node import node_config
from elasticd import proctree
from elasticd.agent import torchrun_command
from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.lab.embedded_etcd import EmbeddedEtcd, free_port
from elasticd.rendezvous.keys import JobKeys

REPO = Path(__file__).resolve().parents[1]
# "-keyed": the same on keyed rounds (``--rdzv-conf rounds=keyed``, rendezvous/keyed.py).
SYSTEMS = ("elasticd", "etcd3", "etcd3-poll", "c10d", "elasticd-keyed", "etcd3-keyed")
MONITOR_INTERVAL_S = 0.1
# The delay between a node's death and its peers' collective failing (gloo, measured
# ~0.1 s in benchmarks/mttr.py).
COLLECTIVE_FAILS_AFTER_S = 0.1
READY_TIMEOUT_S = 240.0
COUNTERS_TIMEOUT_S = 15.0
PROJECT_TO = 2048


# -- etcd's own metrics --------------------------------------------------------------------

def scrape(endpoint: str) -> dict[tuple[str, frozenset], float]:
    """etcd's /metrics on the client URL, as {(name, labels): value}."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if "=" in p)
        out[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out


def metric(metrics: dict, name: str, **labels: str) -> float:
    """Sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= ls)


def by_label(metrics: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, ls), v in metrics.items():
        if n == name:
            key = dict(ls).get(label, "?")
            out[key] = out.get(key, 0.0) + v
    return out


def first_metric(metrics: dict, *names: str) -> float | None:
    """The first of ``names`` etcd exports (names moved between 3.4 and 3.5)."""
    for name in names:
        if any(n == name for n, _ in metrics):
            return metric(metrics, name)
    return None


# -- the packed processes --------------------------------------------------------------------

@dataclass
class Pack:
    """One packed process and the simulated nodes it holds."""

    index: int
    proc: subprocess.Popen
    nodes: list[str]
    victim: bool
    counters: dict[str, Any] = field(default_factory=lambda: {"calls": {}, "probes": {}})
    alive: bool = True

    def send(self, **cmd: Any) -> None:
        if not self.alive:
            return
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.alive = False

    def cpu_s(self) -> float | None:
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return None
        return t.user + t.system


@dataclass
class Snapshot:
    t: float
    etcd: dict
    cpu: dict[int, float]              # pack index -> CPU seconds (the last one known)
    etcd_cpu_s: float
    counters: dict[int, dict[str, Any]]
    load: list[float]


def node_address(i: int) -> str:
    """Node i's own loopback address (all of 127/8 reaches lo on Linux)."""
    return f"127.10.{i // 250}.{i % 250 + 1}"


def c10d_command(job: str, store: str, addr: str, n: int) -> list[str]:
    """Plain torchrun on c10d, tuned as benchmarks/mttr.py's system b (store elsewhere)."""
    return [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={store}", f"--rdzv-id={job}",
            f"--rdzv-conf=is_host=0,{TUNED_CONF}", f"--nnodes={min_nodes(n)}:{n}",
            "--nproc-per-node=1", "--max-restarts=100",
            f"--monitor-interval={MONITOR_INTERVAL_S}", f"--local-addr={addr}", "train.py"]


def min_nodes(n: int) -> int:
    # One below N: the world survives the kill, and the first round completes when all N
    # have joined (max_nodes), or last_call_timeout after the (N-1)th join. Lower minimums
    # let a slow start form a partial world first, then restart everyone for the rest.
    return n - 1


class Cell:
    """One system at one N: its store, its packed processes, and the measurements."""

    def __init__(self, system: str, n: int, procs: int, work: Path, etcd: str | None,
                 log: Callable[[str], None], etcd_dir: str | None = None) -> None:
        if system not in SYSTEMS:
            raise ValueError(f"unknown system {system!r}; one of {SYSTEMS}")
        if n < 3:
            raise ValueError("N >= 3: one node is killed and the survivors must re-form")
        self.system, self.n, self.work, self.log = system, n, work, log
        self.job = f"scale-{system}-{n}-{os.getpid()}-{int(time.time())}"
        self.procs = max(1, min(procs, n - 1))
        self.events: queue.Queue = queue.Queue()
        self.packs: list[Pack] = []
        self.latest: dict[str, dict[str, Any]] = {}   # node -> its newest world event
        self.worlds: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self._etcd_owned: EmbeddedEtcd | None = None
        self._store_proc: subprocess.Popen | None = None
        self.etcd_endpoint = etcd
        self.etcd_dir = etcd_dir
        self._etcd_data: str | None = None
        self._seq = 0

    # -- set-up and tear-down --------------------------------------------------------------

    def start_store(self) -> str:
        """etcd for elasticd/etcd3 (the given one, else a fresh one), a TCPStore for c10d."""
        if self.system == "c10d":
            port = free_port()
            code = ("import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', "
                    f"{port}, is_master=True, wait_for_workers=False, multi_tenant=True); "
                    "print('up', flush=True); time.sleep(1e9)")
            self._store_proc = subprocess.Popen(
                proctree.with_parent_death_signal([sys.executable, "-c", code]),
                stdout=subprocess.PIPE, text=True)
            if self._store_proc.stdout.readline().strip() != "up":
                raise RuntimeError("the c10d store process did not start")
            return f"127.0.0.1:{port}"
        if self.etcd_endpoint is None:
            data = None
            if self.etcd_dir:
                data = tempfile.mkdtemp(prefix="elasticd-scale-etcd-", dir=self.etcd_dir)
                self._etcd_data = data
            self._etcd_owned = EmbeddedEtcd(data_dir=data).start()
            self.etcd_endpoint = self._etcd_owned.endpoint
        return self.etcd_endpoint

    def node_specs(self, store: str) -> list[dict[str, Any]]:
        specs = []
        for i in range(self.n):
            addr = node_address(i)
            node: dict[str, Any] = {"id": f"n{i:04d}", "addr": addr}
            if self.system == "c10d":
                node["command"] = c10d_command(self.job, store, addr, self.n)
            elif self.system.startswith("etcd3"):
                node["command"] = torchrun_command(
                    node_config(self.base_spec(store), node), 1)
            specs.append(node)
        return specs

    def base_spec(self, store: str) -> dict[str, Any]:
        return {"system": self.system, "job": self.job, "etcd": store,
                "torch_poll": self.system == "etcd3-poll",
                "rounds": "keyed" if self.system.endswith("-keyed") else "torch",
                "min_nodes": min_nodes(self.n), "max_nodes": self.n,
                "run_dir": str(self.work / "nodes"), "log_level": "INFO"}

    def start_packs(self, store: str) -> None:
        nodes = self.node_specs(store)
        survivors, victim = nodes[:-1], nodes[-1:]
        groups = [survivors[i::self.procs] for i in range(self.procs)] + [victim]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
                   TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        for index, group in enumerate(groups):
            log_path = self.work / f"pack-{index}.log"
            with open(log_path, "ab") as log:
                proc = subprocess.Popen(
                    proctree.with_parent_death_signal(
                        [sys.executable, "-m", "benchmarks.scale_node"]),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                    cwd=REPO, env=env)
            pack = Pack(index, proc, [g["id"] for g in group], victim=group is victim)
            pack.send(**self.base_spec(store), nodes=group)
            threading.Thread(target=self._read, args=(pack,), daemon=True).start()
            self.packs.append(pack)

    def _read(self, pack: Pack) -> None:
        for line in pack.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put((pack.index, json.loads(line)))
        self.events.put((pack.index, {"ev": "eof"}))

    def stop(self) -> list[int]:
        """Kill everything this cell started; the pids that survived (should be none)."""
        procs = [p.proc for p in self.packs]
        if self._store_proc is not None:
            procs.append(self._store_proc)
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.kill()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if self._etcd_owned is not None:
            self._etcd_owned.stop()
        if self._etcd_data is not None:
            shutil.rmtree(self._etcd_data, ignore_errors=True)
            Path(self._etcd_data).with_suffix(".log").unlink(missing_ok=True)
        left = [p.pid for p in procs if psutil.pid_exists(p.pid) and _not_zombie(p.pid)]
        return left

    # -- events ------------------------------------------------------------------------------

    def pump(self, until: Callable[[], bool], timeout_s: float) -> bool:
        """Apply events until ``until()`` holds (True) or ``timeout_s`` passes (False)."""
        end = time.monotonic() + timeout_s
        while not until():
            left = end - time.monotonic()
            if left <= 0:
                return False
            try:
                index, event = self.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            self.apply(index, event)
        return True

    def apply(self, index: int, event: dict[str, Any]) -> None:
        kind = event.get("ev")
        pack = self.packs[index]
        if kind == "world":
            self.latest[event["node"]] = event
            self.worlds.append(event)
        elif kind == "counters":
            pack.counters = event
            pack.counters_seq = event.get("seq")
        elif kind == "ready":
            pack.ready = True
        elif kind == "error":
            self.errors.append(event)
            if len(self.errors) <= 5:
                self.log(f"  error on {event.get('node')}: {event.get('error')}")
        elif kind == "eof":
            pack.alive = False

    def all_in_world(self, nodes: Iterable[str], size: int, after: float = 0.0) -> bool:
        events = [self.latest.get(n) for n in nodes]
        if not all(e and e["world_size"] == size and e["t"] > after for e in events):
            return False
        return len({e["round"] for e in events}) == 1

    def snapshot(self) -> Snapshot:
        self._seq += 1
        seq = self._seq
        live = [p for p in self.packs if p.alive]
        for pack in live:
            pack.send(cmd="counters", seq=seq)
        self.pump(lambda: all(getattr(p, "counters_seq", None) == seq or not p.alive for p in live),
                  COUNTERS_TIMEOUT_S)
        etcd, etcd_cpu = {}, 0.0
        if self.system != "c10d":
            etcd = scrape(self.etcd_endpoint)
            etcd_cpu = metric(etcd, "process_cpu_seconds_total")
        elif self._store_proc is not None:
            with contextlib.suppress(psutil.Error):
                t = psutil.Process(self._store_proc.pid).cpu_times()
                etcd_cpu = t.user + t.system
        cpu = {}
        for pack in self.packs:
            value = pack.cpu_s()
            cpu[pack.index] = value if value is not None else getattr(pack, "last_cpu", 0.0)
            pack.last_cpu = cpu[pack.index]
        return Snapshot(time.time(), etcd, cpu, etcd_cpu,
                        {p.index: dict(p.counters) for p in self.packs}, loadavg())

    def rdzv_state_bytes(self) -> int | None:
        """The size of torch's pickled rendezvous state: what every heartbeat rewrites."""
        client = EtcdClient(EtcdSettings(endpoints=(self.etcd_endpoint,), retry_s=5.0))
        try:
            kv = client.get(JobKeys(self.job).rdzv_state)
        finally:
            client.close()
        return None if kv is None else len(kv.value)

    # -- the measurement -------------------------------------------------------------------------

    def run(self, form_timeout_s: float, reform_timeout_s: float, settle_s: float,
            steady_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {"system": self.system, "nodes": self.n, "procs": self.procs + 1,
                               "min_nodes": min_nodes(self.n), "job": self.job}
        store = self.start_store()
        self.start_packs(store)
        ready = self.pump(lambda: all(getattr(p, "ready", False) for p in self.packs),
                          READY_TIMEOUT_S)
        if not ready:
            out["error"] = f"the packed processes were not ready in {READY_TIMEOUT_S:.0f} s"
            return out
        everyone = [node for p in self.packs for node in p.nodes]
        base = self.snapshot()
        t_go = time.time()
        for pack in self.packs:
            pack.send(cmd="go")
        formed = self.pump(lambda: self.all_in_world(everyone, self.n), form_timeout_s)
        t_formed = time.time()
        first = min((w["t"] for w in self.worlds), default=None)
        out["form"] = {
            "formed": formed, "timeout_s": form_timeout_s,
            "form_s": round(max(self.latest[n]["t"] for n in everyone) - t_go, 3) if formed else None,
            "first_world_s": round(first - t_go, 3) if first else None,
            "largest_world": max((w["world_size"] for w in self.worlds), default=0),
            "rounds": sorted({w["round"] for w in self.worlds if w["round"] is not None}),
        }
        after_form = self.snapshot()
        out["form"]["window"] = rates(base, after_form, self.n, self.packs)
        self.log(f"  {self.system} N={self.n}: " + (
            f"formed in {out['form']['form_s']:.2f} s" if formed
            else f"did not form in {form_timeout_s:.0f} s (largest world "
                 f"{out['form']['largest_world']})"))
        self.pump(lambda: False, settle_s)
        start = self.snapshot()
        self.pump(lambda: False, steady_s)
        end = self.snapshot()
        out["steady"] = rates(start, end, self.n, self.packs)
        out["steady"]["state"] = state_figures(end.etcd)
        if start.etcd and end.etcd:
            grew = (state_figures(end.etcd).get("db_bytes") or 0) - (
                state_figures(start.etcd).get("db_bytes") or 0)
            out["steady"]["db_growth_bytes_per_s"] = grew / max(end.t - start.t, 1e-6)
            out["steady"]["rdzv_state_bytes"] = self.rdzv_state_bytes()
        if not formed:
            out["reform"] = {"reformed": False, "skipped": "the first world did not form"}
            return out
        victim = next(p for p in self.packs if p.victim)
        survivors = [n for p in self.packs if not p.victim for n in p.nodes]
        t_kill = time.time()
        victim.proc.send_signal(signal.SIGKILL)
        time.sleep(COLLECTIVE_FAILS_AFTER_S)
        for pack in self.packs:
            if not pack.victim:
                pack.send(cmd="fail")
        reformed = self.pump(lambda: self.all_in_world(survivors, self.n - 1, after=t_kill),
                             reform_timeout_s)
        done = self.snapshot()
        victim.alive = False
        out["reform"] = {
            "reformed": reformed, "timeout_s": reform_timeout_s,
            "reform_s": round(max(self.latest[n]["t"] for n in survivors) - t_kill, 3)
            if reformed else None,
            "first_survivor_s": round(min((w["t"] for w in self.worlds if w["t"] > t_kill),
                                          default=math.nan) - t_kill, 3),
            "largest_world": max((w["world_size"] for w in self.worlds if w["t"] > t_kill),
                                 default=0),
            "rounds": sorted({w["round"] for w in self.worlds
                              if w["t"] > t_kill and w["round"] is not None}),
            "window": rates(end, done, self.n - 1, self.packs),
        }
        self.log(f"  {self.system} N={self.n}: " + (
            f"re-formed in {out['reform']['reform_s']:.2f} s after the kill" if reformed
            else f"did not re-form in {reform_timeout_s:.0f} s"))
        out["formed_after_s"] = round(t_formed - t_go, 3)
        return out


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# -- figures from two snapshots -----------------------------------------------------------------

def rates(a: Snapshot, b: Snapshot, nodes: int, packs: list[Pack]) -> dict[str, Any]:
    """Per node per second between snapshots ``a`` and ``b`` (``nodes`` alive in between)."""
    dt = max(b.t - a.t, 1e-6)
    out: dict[str, Any] = {"seconds": round(dt, 3), "nodes": nodes, "load": b.load}
    cpu = sum(b.cpu[i] - a.cpu.get(i, 0.0) for i in b.cpu)
    out["cpu_per_node"] = cpu / dt / nodes              # cores (CPU-seconds per second)
    out["cpu_all_nodes"] = cpu / dt
    out["store_cpu"] = (b.etcd_cpu_s - a.etcd_cpu_s) / dt
    # The packed nodes and their store used (nearly) every core: times are then the
    # machine's, rates lower bounds.
    out["saturated"] = out["cpu_all_nodes"] + out["store_cpu"] >= 0.85 * (os.cpu_count() or 1)
    calls = _delta_counts(a, b, "calls")
    probes = _delta_counts(a, b, "probes")
    out["client_counts"] = calls
    out["client_calls_per_node_s"] = sum(calls.values()) / dt / nodes
    out["client_calls_by_kind"] = {k: round(v / dt / nodes, 4) for k, v in sorted(calls.items())}
    out["probes_per_node_s"] = sum(probes.values()) / dt / nodes
    out["probes_by_outcome"] = {k: round(v / dt / nodes, 3) for k, v in sorted(probes.items())}
    if a.etcd and b.etcd:
        def d(name: str, **labels: str) -> float:
            return metric(b.etcd, name, **labels) - metric(a.etcd, name, **labels)
        received = by_label(b.etcd, "grpc_server_msg_received_total", "grpc_method")
        before = by_label(a.etcd, "grpc_server_msg_received_total", "grpc_method")
        by_method = {m: (v - before.get(m, 0.0)) / dt / nodes for m, v in received.items()}
        out["etcd_requests_per_node_s"] = sum(by_method.values())
        out["etcd_requests_by_method"] = {m: round(v, 4) for m, v in sorted(by_method.items()) if v}
        out["etcd_bytes_in_per_node_s"] = d("etcd_network_client_grpc_received_bytes_total") / dt / nodes
        out["etcd_bytes_out_per_node_s"] = d("etcd_network_client_grpc_sent_bytes_total") / dt / nodes
        out["etcd_bytes_per_node_s"] = out["etcd_bytes_in_per_node_s"] + out["etcd_bytes_out_per_node_s"]
        writes = sum((first_metric(b.etcd, name) or 0.0) - (first_metric(a.etcd, name) or 0.0)
                     for name in ("etcd_mvcc_put_total", "etcd_mvcc_delete_total"))
        if not writes:
            writes = sum((first_metric(b.etcd, name) or 0.0) - (first_metric(a.etcd, name) or 0.0)
                         for name in ("etcd_debugging_mvcc_put_total",
                                      "etcd_debugging_mvcc_delete_total"))
        out["etcd_writes"] = writes
        fsyncs = d("etcd_disk_wal_fsync_duration_seconds_count")
        out["etcd_wal_fsyncs_per_s"] = fsyncs / dt
        out["etcd_wal_fsync_mean_ms"] = (
            1000 * d("etcd_disk_wal_fsync_duration_seconds_sum") / fsyncs if fsyncs else None)
        out["etcd_requests"] = sum(by_method.values()) * dt * nodes
        out["etcd_counts"] = {m: v * dt * nodes for m, v in by_method.items() if v}
    return out


def _delta_counts(a: Snapshot, b: Snapshot, what: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for index, counters in b.counters.items():
        before = a.counters.get(index, {}).get(what, {})
        for key, value in counters.get(what, {}).items():
            out[key] = out.get(key, 0.0) + value - before.get(key, 0.0)
    return out


def state_figures(etcd: dict) -> dict[str, Any]:
    """etcd's size and watch load at a moment: what sizing needs."""
    if not etcd:
        return {}
    return {
        "watchers": first_metric(etcd, "etcd_debugging_mvcc_watcher_total"),
        "watch_streams": first_metric(etcd, "etcd_debugging_mvcc_watch_stream_total"),
        "keys": first_metric(etcd, "etcd_debugging_mvcc_keys_total"),
        "db_bytes": first_metric(etcd, "etcd_mvcc_db_total_size_in_bytes",
                                 "etcd_debugging_mvcc_db_total_size_in_bytes"),
        "db_in_use_bytes": first_metric(etcd, "etcd_mvcc_db_total_size_in_use_in_bytes"),
        "leases": first_metric(etcd, "etcd_debugging_lease_granted_total"),
        "grpc_streams": metric(etcd, "grpc_server_started_total", grpc_type="bidi_stream")
        - metric(etcd, "grpc_server_handled_total", grpc_type="bidi_stream"),
        "revision": first_metric(etcd, "etcd_debugging_mvcc_current_revision"),
    }


# -- the figures, their fits and plots ------------------------------------------------------------

# (key, title, unit, getter): every figure the table, the fits and the plots show.
FIGURES: list[tuple[str, str, str, Callable[[dict], float | None]]] = [
    ("form_s", "first world of N formed", "s", lambda c: c.get("form", {}).get("form_s")),
    ("reform_s", "re-formed after one node killed", "s",
     lambda c: c.get("reform", {}).get("reform_s")),
    ("etcd_req_steady", "etcd requests per node per second, steady", "req/s/node",
     lambda c: c.get("steady", {}).get("etcd_requests_per_node_s")),
    ("etcd_req_reform", "etcd requests per node per second, re-form", "req/s/node",
     lambda c: c.get("reform", {}).get("window", {}).get("etcd_requests_per_node_s")),
    ("etcd_bytes_steady", "etcd bytes per node per second, steady", "B/s/node",
     lambda c: c.get("steady", {}).get("etcd_bytes_per_node_s")),
    ("etcd_bytes_reform", "etcd bytes per node per second, re-form", "B/s/node",
     lambda c: c.get("reform", {}).get("window", {}).get("etcd_bytes_per_node_s")),
    ("cpu_steady", "CPU per node, steady", "cores",
     lambda c: c.get("steady", {}).get("cpu_per_node")),
    ("probes_steady", "probes per daemon per second, steady", "probes/s",
     lambda c: c.get("steady", {}).get("probes_per_node_s")),
]


def figure(cell: dict, key: str) -> float | None:
    """``key`` of ``cell``; None where it was not measured. A cell whose first world never
    formed has no steady state (its window after the cap is a rendezvous still trying)."""
    if key not in ("form_s", "reform_s") and not cell.get("form", {}).get("formed"):
        return None
    getter = next(g for k, _, _, g in FIGURES if k == key)
    value = getter(cell)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def power_fit(points: list[tuple[int, float]]) -> dict[str, float] | None:
    """Least squares of log y = log a + b log N over the points with y > 0."""
    pts = [(math.log(n), math.log(y)) for n, y in points if y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    a = math.exp(my - b * mx)
    return {"a": a, "exponent": b, "at_2048": a * PROJECT_TO ** b,
            "fit_from": [math.exp(x) for x, _ in pts]}


def projections(cells: list[dict]) -> dict[str, dict[str, Any]]:
    """Per system and figure: the power law over the measured N (N >= 32 where there are
    two such points: the small sizes are dominated by fixed costs), at 2,048 nodes."""
    out: dict[str, dict[str, Any]] = {}
    for system in sorted({c["system"] for c in cells}):
        mine = [c for c in cells if c["system"] == system]
        out[system] = {}
        for key, *_ in FIGURES:
            pts = [(c["nodes"], figure(c, key)) for c in mine if figure(c, key) is not None]
            big = [p for p in pts if p[0] >= 32]
            fit = power_fit(big if len(big) >= 2 else pts)
            if fit is not None:
                out[system][key] = fit
    return out


def plot(cells: list[dict], prefix: Path) -> list[str]:
    """One PNG per figure, each system a line against N (log-x; log-y where it spans)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    colors = dict(zip(SYSTEMS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                "tab:brown"), strict=True))
    for key, title, unit, _ in FIGURES:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        drawn = False
        for system in SYSTEMS:
            mine = sorted((c for c in cells if c["system"] == system), key=lambda c: c["nodes"])
            shown = [(c["nodes"], figure(c, key)) for c in mine if figure(c, key) is not None]
            if key == "probes_steady" and not system.startswith("elasticd"):
                shown = []     # no daemon, no prober: the figure does not apply (the table's "-")
            if shown:
                drawn = True
                ax.plot([n for n, _ in shown], [y for _, y in shown], marker="o", label=system,
                        color=colors[system])
            if key not in ("form_s", "reform_s"):
                continue
            # A cell that did not form (or re-form) within its cap: an x at the cap.
            missed = [(c["nodes"], c.get("form" if key == "form_s" else "reform", {}))
                      for c in mine if figure(c, key) is None]
            missed = [(n, part["timeout_s"]) for n, part in missed if part.get("timeout_s")]
            if missed:
                drawn = True
                # Nudged apart in N so that systems missing the same cap stay visible.
                nudge = 1 + 0.07 * (SYSTEMS.index(system) - (len(SYSTEMS) - 1) / 2)
                ax.scatter([n * nudge for n, _ in missed], [cap for _, cap in missed], marker="x", s=70,
                           color=colors[system], label=f"{system}: not within the cap", zorder=5)
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xscale("log", base=2)
        ns = sorted({c["nodes"] for c in cells})
        ax.set_xticks(ns, [str(n) for n in ns])
        values = [figure(c, key) for c in cells if figure(c, key)]
        if values and min(values) > 0 and max(values) / min(values) > 30:
            ax.set_yscale("log")
        if key == "form_s":
            ax.axhline(5.0, color="grey", ls="--", lw=0.8, label="target 256: 5 s")
        if key == "reform_s":
            ax.axhline(3.0, color="grey", ls="--", lw=0.8, label="target 256: 3 s")
        if ax.get_yscale() == "linear":
            ax.set_ylim(0, max(values, default=1) * 1.25)   # from 0: not a zoomed-in wiggle
        ax.set_xlabel("simulated nodes N")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = prefix.with_name(f"{prefix.name}-{key}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))
    return written


# -- the report ------------------------------------------------------------------------------------

def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    cells = result["cells"]
    lines = [
        "# Scale: simulated nodes against one etcd",
        "",
        f"One run of `python -m benchmarks.scale {result['argv']}` "
        f"({result['started']}, {result['wall_s']:.0f} s in all) on {result['machine']['cpus']} "
        f"CPUs ({result['machine']['cpu_model']}), etcd {result['machine']['etcd']}, "
        f"torch {result['machine']['torch']}. Nodes packed into {result['settings']['procs']} "
        "processes plus one for the node that is killed; see `benchmarks/scale.py`.",
        "",
        "| system | N | formed in | re-formed in | etcd req/s/node steady | re-form | "
        "etcd B/s/node steady | re-form | CPU/node (cores) | probes/s/daemon | load (1 min) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        form, reform, steady = c.get("form", {}), c.get("reform", {}), c.get("steady", {})
        busy = "*" if form.get("window", {}).get("saturated") else ""
        formed = (f"{form['form_s']:.2f} s{busy}" if form.get("form_s") is not None
                  else f"not in {form.get('timeout_s', 0):.0f} s{busy}" if form
                  else c.get("error", "-"))
        window = reform.get("window", {})
        busy = "*" if window.get("saturated") else ""
        reformed = (f"{reform['reform_s']:.2f} s{busy}" if reform.get("reform_s") is not None
                    else "-" if reform.get("skipped") or not reform
                    else f"not in {reform.get('timeout_s', 0):.0f} s{busy} (largest world "
                         f"{reform.get('largest_world')}, first at {reform.get('first_survivor_s')} s)")
        # Steady-state figures only where a world formed (else the window is still forming).
        fig = {key: figure(c, key) for key, *_ in FIGURES}
        lines.append(
            f"| {c['system']} | {c['nodes']} | {formed} | {reformed} | "
            f"{_fmt(fig['etcd_req_steady'])} | {_fmt(fig['etcd_req_reform'])} | "
            f"{_fmt(fig['etcd_bytes_steady'], 0)} | {_fmt(fig['etcd_bytes_reform'], 0)} | "
            f"{_fmt(fig['cpu_steady'], 4)} | {_fmt(fig['probes_steady'], 1)} | "
            f"{_fmt((steady.get('load') or [None])[0], 1)} |")
    lines += ["", "\\* the nodes and their store used >= 85% of this machine's cores in that "
              "window: the time is the machine's, not a cluster's. `-` under steady state: the "
              "first world never formed, so there was none (the JSON keeps that window's "
              "figures, a rendezvous still forming)."]
    lines += ["", "Requests: etcd's `grpc_server_msg_received_total` (unary calls and stream "
              "messages: lease keep-alives, watch creations). Bytes: in + out "
              "(`etcd_network_client_grpc_*_bytes_total`). c10d has no etcd: its store's CPU "
              "is in the JSON (`store_cpu`).", "",
              "## Where the requests go (steady state, per node per second)", ""]
    for c in cells:
        steady = c.get("steady", {})
        if steady.get("etcd_requests_by_method") and c.get("form", {}).get("formed"):
            methods = ", ".join(f"{m} {v:.2f}" for m, v in steady["etcd_requests_by_method"].items())
            calls = ", ".join(f"{k} {v:.2f}" for k, v in steady["client_calls_by_kind"].items()
                              if v >= 0.01)
            lines.append(f"- {c['system']} N={c['nodes']}: etcd sees {methods}; the clients "
                         f"call {calls}")
    lines += ["", "## etcd state at steady state", "",
              "| system | N | watchers | keys | db bytes | db growth B/s | rdzv state bytes | "
              "writes while forming | formed |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        s = c.get("steady", {}).get("state", {})
        if s:
            lines.append(f"| {c['system']} | {c['nodes']} | {_fmt(s.get('watchers'), 0)} | "
                         f"{_fmt(s.get('keys'), 0)} | {_fmt(s.get('db_bytes'), 0)} | "
                         f"{_fmt(c['steady'].get('db_growth_bytes_per_s'), 0)} | "
                         f"{_fmt(c['steady'].get('rdzv_state_bytes'), 0)} | "
                         f"{_fmt(c.get('form', {}).get('window', {}).get('etcd_writes'), 0)} | "
                         f"{'yes' if c.get('form', {}).get('formed') else 'no'} |")
    lines += ["", f"## Power-law fits, extrapolated to {PROJECT_TO} nodes", "",
              "Over the cells that formed (N >= 32 where two did, else all): a fit through two "
              "points is a slope, not a law; docs/scale.md projects from the mechanisms.", "",
              "| system | figure | exponent | at 2,048 |", "|---|---|---|---|"]
    for system, fits in result["projection"].items():
        for key, title, unit, _ in FIGURES:
            if key in fits:
                f = fits[key]
                lines.append(f"| {system} | {title} | {f['exponent']:.2f} | "
                             f"{_fmt(f['at_2048'])} {unit} |")
    lines += ["", "Plots: " + ", ".join(f"`{Path(p).name}`" for p in result["plots"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="8,32,128,256", help="comma-separated N values")
    parser.add_argument("--systems", default="elasticd,c10d",
                        help=f"comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--procs", type=int, default=4, help="packed processes per cell (+1 victim)")
    parser.add_argument("--form-timeout-s", type=float, default=120.0)
    parser.add_argument("--reform-timeout-s", type=float, default=60.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--etcd", default=None,
                        help="HOST:PORT of an etcd to use (default: a fresh one per cell)")
    parser.add_argument("--etcd-dir", default="/dev/shm",
                        help="where the fresh etcd keeps its data (default tmpfs: this VM's disk "
                             "took ~25 ms a WAL fsync under load; '' for the temp dir)")
    parser.add_argument("--keep-dir", default=None,
                        help="keep each cell's logs under this directory (default: removed)")
    parser.add_argument("--out", default="benchmarks/results/scale", help="output prefix")
    parser.add_argument("--replot", default=None, metavar="JSON",
                        help="only rewrite the markdown and plots of a stored run")
    args = parser.parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        prefix = Path(args.replot).with_suffix("")
        result["projection"] = projections(result["cells"])
        result["plots"] = plot(result["cells"], prefix)
        prefix.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        prefix.with_suffix(".md").write_text(markdown(result))
        return 0
    result = run_all([int(n) for n in args.nodes.split(",")], args.systems.split(","), args,
                     " ".join(argv if argv is not None else sys.argv[1:]))
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(result["cells"], prefix)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    prefix.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0 if not result["leftover_pids"] else 1


def run_all(sizes: list[int], systems: list[str], args: argparse.Namespace,
            argv_text: str = "") -> dict[str, Any]:
    """Every (N, system) cell, in order of N; the cells and their projection."""
    started = time.time()
    result: dict[str, Any] = {"argv": argv_text, "started": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                          time.gmtime(started)),
                              "machine": machine(), "settings": vars(args), "cells": [],
                              "leftover_pids": []}
    for n in sizes:
        for system in systems:
            print(f"[{time.time() - started:7.1f} s] {system} N={n}", flush=True)
            result["cells"].append(run_cell(system, n, args, result["leftover_pids"]))
    result["projection"] = projections(result["cells"])
    result["wall_s"] = time.time() - started
    return result


def run_cell(system: str, n: int, args: argparse.Namespace, leftovers: list[int]) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        if args.keep_dir:
            tmp = Path(args.keep_dir) / f"{system}-{n}"
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix=f"elasticd-scale-{system}-{n}-")))
        cell = Cell(system, n, args.procs, tmp, args.etcd, lambda s: print(s, flush=True),
                    etcd_dir=args.etcd_dir or None)
        try:
            out = cell.run(args.form_timeout_s, args.reform_timeout_s, args.settle_s,
                           args.steady_s)
        finally:
            left = cell.stop()
        out["errors"] = cell.errors[:20]
        out["error_count"] = len(cell.errors)
        if left:
            leftovers.extend(left)
            out["leftover_pids"] = left
        return out


if __name__ == "__main__":
    sys.exit(main())
