"""The daemon's configuration: one TOML file, validated whole at start.

Every section is a frozen dataclass whose ``__post_init__`` checks its own
values; ``load_config`` checks that no key is unknown and then the timing rules
that span sections. Every error names the key, the value and the fix.

Per-node values and secrets can come from the environment instead of the file
(``ENV_OVERRIDES``), so one config file can be shared by every node.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticd.contract.identity import (
    IdentityError,
    WorkerIdentity,
    resolve,
    switch_refusal,
    worker_can,
)
from elasticd.contract.locations import is_url
from elasticd.contract.secret import SecretError, read_secret
from elasticd.contract.settings import (
    DEFAULT_LR_RULE,
    DEFAULT_RECOVERY,
    DEFAULT_RECOVERY_BOUND_S,
    KEEP_LAST_RULE,
    LR_RULES,
    RECOVERY_MODES,
    REFORM_MECHANISMS,
    RecoveryMode,
    is_valid_keep_last,
)
from elasticd.errors import ConfigError
from elasticd.etcd_client import EtcdSettings, parse_endpoint
from elasticd.preemption import PreemptionConfig
from elasticd.rendezvous.keys import DEFAULT_ROUNDS, ROUNDS, check_job_id


def _require(ok: bool, key: str, value: Any, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r} is not valid: {fix}")


_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class JobConfig:
    id: str
    entrypoint: tuple[str, ...]
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int | str = 1
    python: str | None = None   # interpreter for torchrun; default: the daemon's own
    # Workers forked by a per-node server that imported torch once (elasticd.warmstart):
    # a start costs ~0.1 s instead of 2-7 s. Extra modules for it to import first.
    warm_start: bool = True
    warm_imports: tuple[str, ...] = ()
    # The Unix user (and group; default its primary one) the workers run as, so the
    # training code cannot read the daemon's etcd credentials (elasticd.contract.identity).
    # "": the daemon's own user. Checked where a daemon starts (``check_worker_user``).
    worker_user: str = ""
    worker_group: str = ""

    def __post_init__(self) -> None:
        check_job_id(self.id)
        for name in ("worker_user", "worker_group"):
            _require(isinstance(getattr(self, name), str), f"job.{name}", getattr(self, name),
                     "use a user (group) name or number, or leave it out")
        _require(self.worker_user or not self.worker_group, "job.worker_group", self.worker_group,
                 "set job.worker_user too (the group is the workers' user's)")
        _require(bool(self.entrypoint) and all(isinstance(a, str) for a in self.entrypoint),
                 "job.entrypoint", self.entrypoint,
                 'give the training script then its arguments, e.g. ["train.py", "--max-steps", "100"]')
        _require(isinstance(self.min_nodes, int) and self.min_nodes >= 1, "job.min_nodes",
                 self.min_nodes, "use a whole number >= 1")
        _require(isinstance(self.max_nodes, int) and self.max_nodes >= self.min_nodes,
                 "job.max_nodes", self.max_nodes, f"use a whole number >= job.min_nodes ({self.min_nodes})")
        ok = self.nproc_per_node == "auto" or (isinstance(self.nproc_per_node, int)
                                               and self.nproc_per_node >= 1)
        _require(ok, "job.nproc_per_node", self.nproc_per_node, 'use a whole number >= 1 or "auto"')
        _require(all(_MODULE.match(m) for m in self.warm_imports), "job.warm_imports",
                 self.warm_imports, 'list module names to import before forking, e.g. ["transformers"]')

    def resolved_nproc(self) -> int:
        """``auto``: one worker per GPU if CUDA is present, else one."""
        if self.nproc_per_node != "auto":
            return int(self.nproc_per_node)
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 1


@dataclass(frozen=True)
class EtcdConfig(EtcdSettings):
    """``[etcd]``: how to reach etcd (validated by ``EtcdSettings``) and the key prefix."""

    key_prefix: str = "/elasticd"

    def settings(self, retry_s: float | None = None) -> EtcdSettings:
        """The connection settings alone, optionally with another retry budget."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EtcdSettings)}
        if retry_s is not None:
            values["retry_s"] = retry_s
        return EtcdSettings(**values)

    def rdzv_endpoint(self) -> str:
        return ",".join("{}:{}".format(*parse_endpoint(e)) for e in self.endpoints)


@dataclass(frozen=True)
class NodeConfig:
    id: str = field(default_factory=lambda: socket.gethostname().split(".")[0].lower())
    addr: str = "127.0.0.1"
    lease_ttl_s: int = 5
    probe_interval_s: float = 0.5
    # Probe this many ring successors (node-id order); 0: every peer. Each node is then
    # probed by as many predecessors, and a daemon's probes do not grow with the job.
    probe_neighbours: int = 2
    log_dir: str | None = None
    run_dir: str | None = None   # progress and stop files; default: a temp dir per daemon

    def __post_init__(self) -> None:
        check_job_id(self.id)  # same alphabet: it becomes an etcd key
        _require(isinstance(self.lease_ttl_s, int) and self.lease_ttl_s >= 2, "node.lease_ttl_s",
                 self.lease_ttl_s, "use whole seconds >= 2 (the keep-alive runs 3 times per TTL)")
        _require(0 < self.probe_interval_s <= 10, "node.probe_interval_s", self.probe_interval_s,
                 "use seconds in (0, 10]")
        _require(isinstance(self.probe_neighbours, int) and self.probe_neighbours >= 0,
                 "node.probe_neighbours", self.probe_neighbours,
                 "use a whole number >= 0 (0: probe every peer; 2 is the default)")


@dataclass(frozen=True)
class RendezvousConfig:
    last_call_timeout: int = 1
    join_timeout: int = 600
    keep_alive_interval: int = 1
    keep_alive_max_attempt: int = 5
    close_timeout: int = 30
    # The agents' run lease (their c10d store keys, the `closed` key). Keyed rounds keep the
    # job's round, worlds and epoch on no lease, so a lost round leader costs nothing here.
    ttl: int = 7200
    # "keyed": per-agent keys whose etcd writes grow linearly with the nodes
    # (rendezvous/keyed.py; docs/scale.md); "torch": torch's dynamic rendezvous on one
    # shared state.
    rounds: str = DEFAULT_ROUNDS

    def __post_init__(self) -> None:
        _require(self.rounds in ROUNDS, "rendezvous.rounds", self.rounds,
                 'use "keyed" (the default) or "torch" (torch\'s one shared state)')
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "rounds":
                continue
            _require(isinstance(value, int) and value >= 1, f"rendezvous.{f.name}", value,
                     "torch takes whole seconds >= 1")
        product = self.keep_alive_interval * self.keep_alive_max_attempt
        _require(product >= 3, "rendezvous.keep_alive_max_attempt", self.keep_alive_max_attempt,
                 "keep_alive_interval x keep_alive_max_attempt below 3 s evicts live nodes "
                 "(measured split brain); raise it")

    def conf_string(self) -> str:
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = "/var/lib/elasticd/checkpoints"
    every_steps: int = 100
    every_s: float = 0.0
    keep_last: int = 3

    def __post_init__(self) -> None:
        _require(isinstance(self.every_steps, int) and self.every_steps >= 0, "checkpoint.every_steps",
                 self.every_steps, "use a whole number >= 0 (0 = only by time)")
        _require(self.every_s >= 0, "checkpoint.every_s", self.every_s,
                 "use seconds >= 0 (0 = only by steps)")
        _require(is_valid_keep_last(self.keep_last), "checkpoint.keep_last", self.keep_last,
                 KEEP_LAST_RULE)


@dataclass(frozen=True)
class LrConfig:
    rule: str = DEFAULT_LR_RULE   # the workers' default too (elasticd/contract/settings.py)
    # The world size the script's LR is for. None (the default, as for the workers and the
    # plugin): the job's first world, kept in its checkpoints. It used to be 1, so a script
    # that scales its own LR (lr * world_size, as DDP tutorials teach) was scaled twice: 3x
    # the intended LR at world 3.
    base_world_size: int | None = None
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _require(self.rule in LR_RULES, "lr.rule", self.rule, f"use one of {', '.join(LR_RULES)}")
        _require(self.base_world_size is None or (
                     isinstance(self.base_world_size, int) and not isinstance(self.base_world_size, bool)
                     and self.base_world_size >= 1),
                 "lr.base_world_size", self.base_world_size,
                 "use a whole number >= 1 (the world size the script's LR is tuned for), or leave "
                 "it out to take the job's first world size")
        _require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "lr.warmup_steps",
                 self.warmup_steps, "use a whole number >= 0")


@dataclass(frozen=True)
class SupervisorConfig:
    # torchrun's own --max-restarts. Keep it high: it cannot tell a crash from a
    # membership change; the daemon's budget below can, and ends a crash loop.
    worker_restarts: int = 10000
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    crash_loop_failures: int = 5       # this many agent failures without progress ...
    crash_loop_window_s: float = 600.0  # ... within this window mark the node failed
    drain_grace_s: float = 60.0
    monitor_interval_s: float = 0.1
    # Training hang: the workers are alive but the step does not advance for
    # hang_timeout_s (> 0), or by default max(hang_floor_s, hang_factor x the median
    # step time): the node kills its workers and recovers as from a crash.
    hang_timeout_s: float = 0.0
    hang_floor_s: float = 120.0
    hang_factor: float = 20.0
    # A worker group that has not made its first step this long after it started (group
    # init, the resume's collectives and checkpoint load) hangs in its start: killed; a
    # crash unless a peer was unreachable then (its fault, not this node's).
    start_timeout_s: float = 600.0
    # An agent waiting in a round whose world names an agent no live record has (its node
    # evicted, condemned, or restarted) is released after this long, so that the next
    # round forms without it (a record naming a peer's new agent may lag its round by
    # about this much).
    broken_round_grace_s: float = 2.0
    # false: an agent stays in such a round until torchrun's store timeout (torch's own
    # behaviour, a stall of up to that timeout; for comparisons and weakened chaos runs).
    release_broken_rounds: bool = True
    # The workers stop as diverged after this many agreed non-finite losses in a row and
    # the node is marked failed (a restart would diverge again); 0 disables the check.
    nonfinite_loss_limit: int = 3

    def __post_init__(self) -> None:
        _require(isinstance(self.nonfinite_loss_limit, int) and self.nonfinite_loss_limit >= 0,
                 "supervisor.nonfinite_loss_limit", self.nonfinite_loss_limit,
                 "use a whole number >= 0 (0 = never stop on a non-finite loss)")
        _require(self.worker_restarts >= 0, "supervisor.worker_restarts", self.worker_restarts,
                 "use a whole number >= 0")
        _require(0 < self.backoff_initial_s <= self.backoff_max_s, "supervisor.backoff_initial_s",
                 self.backoff_initial_s, "use seconds > 0 and <= supervisor.backoff_max_s")
        _require(self.crash_loop_failures >= 1, "supervisor.crash_loop_failures",
                 self.crash_loop_failures, "use a whole number >= 1")
        _require(self.crash_loop_window_s > 0, "supervisor.crash_loop_window_s",
                 self.crash_loop_window_s, "use seconds > 0")
        _require(self.drain_grace_s > 0, "supervisor.drain_grace_s", self.drain_grace_s, "use seconds > 0")
        _require(0 < self.monitor_interval_s <= 5, "supervisor.monitor_interval_s",
                 self.monitor_interval_s, "use seconds in (0, 5]")
        _require(self.hang_timeout_s >= 0, "supervisor.hang_timeout_s", self.hang_timeout_s,
                 "use seconds >= 0 (0 = derived from the measured step time)")
        _require(self.hang_floor_s > 0, "supervisor.hang_floor_s", self.hang_floor_s,
                 "use seconds > 0 (the shortest stall that counts as a hang)")
        _require(self.hang_factor >= 2, "supervisor.hang_factor", self.hang_factor,
                 "use a number >= 2 (times the median step time)")
        _require(self.start_timeout_s > 0, "supervisor.start_timeout_s", self.start_timeout_s,
                 "use seconds > 0 (longer than your workers' start-up and checkpoint load)")
        _require(isinstance(self.release_broken_rounds, bool), "supervisor.release_broken_rounds",
                 self.release_broken_rounds, "use true or false")
        _require(self.broken_round_grace_s > 0, "supervisor.broken_round_grace_s",
                 self.broken_round_grace_s, "use seconds > 0 (2 s: a record's lag behind its round)")


@dataclass(frozen=True)
class RecoveryConfig:
    """``[recovery]``: how workers recover from a lost peer (docs/architecture.md).

    ``in-place``: the survivors keep their processes and re-form the group through the
    daemons' agreed generation; ``restart``: they are killed and torchrun starts new ones.
    """

    mode: str = DEFAULT_RECOVERY   # a RecoveryMode once validated (TOML gives its text)
    bound_s: float = DEFAULT_RECOVERY_BOUND_S   # longest a re-form may take (worker side)
    store_port: int = 0                         # the daemon's TCP store; 0 = ephemeral
    reform: str = "auto"    # torch's reconfigure where it can (trainer/reform.py), or destroy-init
    # true: a node that joins a live in-place job (keyed rounds) enters it without restarting
    # the members' workers (supervisor.joining); false: a join is a torchrun round, which
    # restarts every worker (on GPUs: CUDA, NCCL, compile and a checkpoint load each time).
    join_in_place: bool = True
    # The job's secret (elasticd.contract.secret): every member of an in-place group proves
    # it before any state is taken from it. "": groups form unauthenticated. Checked where
    # a daemon starts (``check_secret_file``), not by every reader of the config.
    secret_file: str = ""

    def __post_init__(self) -> None:
        _require(isinstance(self.join_in_place, bool), "recovery.join_in_place",
                 self.join_in_place, "use true or false")
        _require(isinstance(self.secret_file, str), "recovery.secret_file", self.secret_file,
                 "use the path of the job's secret file, or leave it out")

        _require(self.mode in RECOVERY_MODES, "recovery.mode", self.mode,
                 f"use one of {', '.join(repr(m) for m in RECOVERY_MODES)}")
        object.__setattr__(self, "mode", RecoveryMode(self.mode))
        _require(self.reform in REFORM_MECHANISMS, "recovery.reform", self.reform,
                 f"use one of {', '.join(repr(m) for m in REFORM_MECHANISMS)}")
        _require(0 < self.bound_s <= 600, "recovery.bound_s", self.bound_s,
                 "use seconds in (0, 600] (the longest an in-place re-form may take)")
        _require(0 <= self.store_port < 65536, "recovery.store_port", self.store_port,
                 "use 0 (an ephemeral port) or a free TCP port")


def check_worker_user(config: Config) -> WorkerIdentity | None:
    """``[job] worker_user`` must be usable where a daemon starts: the user exists, this
    process can switch to it, and it can use what the workers need (the checkpoint
    directory, the job's secret). Its identity, or None when unset; ``ConfigError``
    naming the fix otherwise."""
    job = config.job
    if not job.worker_user:
        return None
    try:
        identity = resolve(job.worker_user, job.worker_group)
    except IdentityError as exc:
        raise ConfigError(f"[job] worker_user: {exc}") from None
    refusal = switch_refusal(identity)
    if refusal:
        raise ConfigError(f"[job] worker_user = {job.worker_user!r}: {refusal}")
    script = job.entrypoint[0] if not job.entrypoint[0].startswith("-") else ""
    needs = [(config.checkpoint.dir, "rwx", "[checkpoint] dir"),
             (config.recovery.secret_file, "r", "[recovery] secret_file"),
             (script, "r", "[job] entrypoint")]
    for path, modes, key in needs:
        place = _existing(path) if path else None
        if place and not worker_can(identity, place, modes if place == path else "wx"):
            raise ConfigError(
                f"{key} = {path!r}: the workers' user {job.worker_user!r} cannot "
                f"{'read' if modes == 'r' else 'write'} {place}; give its group "
                f"(gid {identity.gid}) access (chgrp {identity.gid} {place}; chmod "
                f"{'g+r' if modes == 'r' else 'g+rwx'} {place})")
    return identity


def _existing(path: str) -> str | None:
    """``path`` or, where it is not made yet, its nearest existing parent; None for a
    bucket URL (object storage has no Unix permissions to check)."""
    if is_url(path):
        return None
    for place in (Path(path), *Path(path).parents):
        if place.exists():
            return str(place)
    return None


def check_secret_file(recovery: RecoveryConfig) -> None:
    """``[recovery] secret_file`` must be usable where a daemon starts (``ConfigError``
    naming the fix); checked there, not by every reader of the config (``status``)."""
    if recovery.secret_file:
        try:
            read_secret(recovery.secret_file)
        except SecretError as exc:
            raise ConfigError(f"[recovery] secret_file: {exc}") from None


@dataclass(frozen=True)
class MetricsConfig:
    port: int = 0                      # 0 = no metrics endpoint
    addr: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, "metrics.port", self.port, "use 0 (off) or a TCP port")


@dataclass(frozen=True)
class Config:
    job: JobConfig
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lr: LrConfig = field(default_factory=LrConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    source: str = "<dict>"

    def __post_init__(self) -> None:
        _check_timing(self)


def _check_timing(config: Config) -> None:
    rdzv, node = config.rendezvous, config.node
    evict_s = rdzv.keep_alive_interval * rdzv.keep_alive_max_attempt
    # The daemon evicts a dead peer from the rendezvous when its lease expires; torch's
    # own keep-alive eviction must not fire first on a node that is merely slow.
    _require(evict_s >= 3, "rendezvous.keep_alive_interval", rdzv.keep_alive_interval,
             "keep-alive eviction must be >= 3 s")
    _require(node.probe_interval_s < node.lease_ttl_s, "node.probe_interval_s", node.probe_interval_s,
             f"probe more often than the lease TTL ({node.lease_ttl_s} s)")
    _require(config.supervisor.drain_grace_s > rdzv.last_call_timeout, "supervisor.drain_grace_s",
             config.supervisor.drain_grace_s, "the drain grace must exceed rendezvous.last_call_timeout")


# Environment variables that override one key each (per-node values and secrets).
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    "ELASTICD_JOB_ID": ("job", "id"),
    "ELASTICD_NODE_ID": ("node", "id"),
    "ELASTICD_NODE_ADDR": ("node", "addr"),
    "ELASTICD_ETCD_ENDPOINTS": ("etcd", "endpoints"),
    "ELASTICD_ETCD_USER": ("etcd", "user"),
    "ELASTICD_ETCD_PASSWORD": ("etcd", "password"),
    "ELASTICD_CHECKPOINT_DIR": ("checkpoint", "dir"),
    # The metrics endpoint's bind address differs per node (its private address) where a
    # scraper on another machine reads it; the shared file keeps the loopback default.
    "ELASTICD_METRICS_ADDR": ("metrics", "addr"),
}

_SECTIONS: dict[str, type] = {
    "job": JobConfig, "etcd": EtcdConfig, "node": NodeConfig, "rendezvous": RendezvousConfig,
    "checkpoint": CheckpointConfig, "lr": LrConfig, "supervisor": SupervisorConfig,
    "preemption": PreemptionConfig, "metrics": MetricsConfig, "recovery": RecoveryConfig,
}
# Sections that hot-reload on SIGHUP without restarting anything.
# checkpoint and lr reach the workers through the agent's environment: they apply
# from the next agent start.
RELOADABLE = ("checkpoint", "lr", "supervisor", "preemption")


def load_config(path: str | os.PathLike[str], env: dict[str, str] | None = None) -> Config:
    """Read, override from ``env`` (default ``os.environ``) and validate a TOML config."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --config PATH") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return config_from_dict(raw, env if env is not None else dict(os.environ), source=str(path))


def config_from_dict(raw: dict[str, Any], env: dict[str, str] | None = None,
                     source: str = "<dict>") -> Config:
    raw = _apply_env(_copy_sections(raw), env or {})
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{source}: unknown section(s) {unknown}; known: {sorted(_SECTIONS)}")
    if "job" not in raw:
        raise ConfigError(f"{source}: the [job] section is required (id and entrypoint at least)")
    sections = {name: _build(name, _SECTIONS[name], values) for name, values in raw.items()}
    try:
        return Config(**sections, source=source)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _copy_sections(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise ConfigError(f"top-level key {name!r} must be a [section] table")
        out[name] = dict(values)
    return out


def _apply_env(raw: dict[str, dict[str, Any]], env: dict[str, str]) -> dict[str, dict[str, Any]]:
    for var, (section, key) in ENV_OVERRIDES.items():
        if var in env and env[var] != "":
            value: Any = env[var]
            if key == "endpoints":
                value = [e.strip() for e in value.split(",") if e.strip()]
            raw.setdefault(section, {})[key] = value
    return raw


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    """One section's dataclass from its TOML table; every error names the key and the fix.

    Types are checked here, against the dataclass annotations, before ``__post_init__``
    runs: its range checks would otherwise hit a TypeError (``0 < "x"``) or, worse, accept
    a wrong type that happens to iterate (a string where a list of strings is expected).
    """
    import json
    import types
    import typing

    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"[{section}] has unknown key(s) {unknown}; known: {sorted(known)}")
    missing = [name for name, f in known.items() if f.init and name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"[{section}] is incomplete: the required key(s) {', '.join(missing)} "
                          f"are missing; add them to [{section}]")
    hints = typing.get_type_hints(cls)

    def accepts(hint: Any, value: Any) -> bool:
        origin = typing.get_origin(hint)
        if hint is Any:
            return True
        if origin in (typing.Union, types.UnionType):
            return any(accepts(arg, value) for arg in typing.get_args(hint))
        if hint is type(None):
            return value is None
        if hint is bool:
            return isinstance(value, bool)
        if hint is int:      # TOML true/false are not numbers, although bool subclasses int
            return isinstance(value, int) and not isinstance(value, bool)
        if hint is float:    # TOML writes whole seconds as integers: 600 is a valid float
            return isinstance(value, int | float) and not isinstance(value, bool)
        if hint is str:
            return isinstance(value, str)
        if origin is tuple:
            item = typing.get_args(hint)[0]
            return isinstance(value, list | tuple) and all(accepts(item, v) for v in value)
        return True          # a type this check does not know: __post_init__ decides

    def expected(hint: Any, key: str) -> tuple[str, str]:
        """(what the type is in words, an example line that is right)."""
        origin = typing.get_origin(hint)
        if origin in (typing.Union, types.UnionType):
            parts = [expected(arg, key) for arg in typing.get_args(hint) if arg is not type(None)]
            return " or ".join(p[0] for p in parts), parts[0][1]
        if hint is bool:
            return "true or false", f"{key} = true"
        if hint is int:
            return "a whole number", f"{key} = 2"
        if hint is float:
            return "a number", f"{key} = 1.5"
        if hint is str:
            return "a string", f'{key} = "..."'
        if origin is tuple:
            return "a list of strings", f'{key} = ["a", "b"]'
        return str(hint), f"{key} = ..."

    def fix(hint: Any, key: str, value: Any) -> str:
        _, example = expected(hint, key)
        # The most common slips get the corrected line itself.
        if isinstance(value, str) and value.strip().lstrip("-").replace(".", "", 1).isdigit():
            number = float(value) if "." in value else int(value)
            if accepts(hint, number):
                return f"write it without quotes: {key} = {number}"
        if isinstance(value, str) and accepts(hint, [value]):
            return f"write it as a list: {key} = {json.dumps([value])}"
        if isinstance(value, list) and len(value) == 1 and accepts(hint, value[0]):
            return f"write the one value, not a list: {key} = {json.dumps(value[0])}"
        return f"write it like {example}"

    for key, value in values.items():
        hint = hints.get(key, Any)
        if not accepts(hint, value):
            what, _ = expected(hint, key)
            raise ConfigError(f"[{section}] {key} = {value!r} has the wrong type "
                              f"({type(value).__name__}); expected {what}: {fix(hint, key, value)}")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        # The checks above leave no TypeError that names a key; say which section at least.
        raise ConfigError(f"[{section}] has a value of the wrong type: {exc}") from None
    except ConfigError as exc:
        raise ConfigError(f"[{section}] {exc}") from None
