"""Build torch's dynamic rendezvous handler on the etcd v3 backend and store.

``--rdzv-conf`` keys (all optional)::

    rounds=keyed|torch          keyed: per-agent keys, etcd writes linear in the nodes
                                (keyed.py, the default); torch: torch's dynamic rendezvous
                                on one shared state (writes grow with the square of the nodes)
    key_prefix=/elasticd        root of the job's keys (<key_prefix>/<run_id>/rdzv/...)
    ttl=7200                    seconds the run's keys outlive the last live agent
    read_timeout=5              seconds per etcd request
    retry_timeout=30            seconds an etcd outage is retried before an error
    protocol=http|https         https needs ca_cert
    ca_cert=, ssl_cert=, ssl_cert_key=    TLS files (PEM)
    user=, password=            etcd auth; else one JSON line on stdin when
                                ELASTICD_ETCD_AUTH_STDIN=1 (the daemon's way), else
                                ELASTICD_ETCD_USER / ELASTICD_ETCD_PASSWORD
    join_timeout, last_call_timeout, close_timeout, heartbeat_timeout,
    keep_alive_interval, keep_alive_max_attempt    torch's dynamic rendezvous knobs
    cas_backoff_max_seconds     rounds=torch on torch >= 2.15: after a lost compare-and-set of
                                the shared state, an agent waits a random 0..N seconds before
                                the next try (spreads the agents under contention); torch's
                                default 0 when unset; ignored with a warning on older torch
                                and by keyed rounds, which have no shared state to contend on
    recovery=restart|in-place   after a lost peer agent: restart the workers (torch's way,
                                the default), or let the survivors re-form their group in
                                place (companion.py; needs the trainer library; each agent
                                then listens on two more TCP ports)

``--rdzv-endpoint`` takes one or more ``HOST:PORT`` separated by commas.

Credentials never reach the workers: torchrun starts them with a copy of the agent's
environment and its stdin, so the handler (built before any worker starts) removes the
credential variables from ``os.environ`` and, in stdin mode, replaces fd 0 with /dev/null
after reading the one line.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.contract.settings import IN_PLACE, RECOVERY_MODES, UNAGREED_RECOVERY, RecoveryMode
from elasticd.errors import ConfigError, EtcdError
from elasticd.etcd_client import EtcdClient, EtcdSettings, no_retry
from elasticd.lease import LeaseKeeper
from elasticd.rendezvous.backend import CheckedBackend, EtcdV3RendezvousBackend
from elasticd.rendezvous.closed import DAEMON_PID_ENV, closed_message
from elasticd.rendezvous.keyed import KeyedRendezvousHandler
from elasticd.rendezvous.keys import (
    DEFAULT_ROOT,
    DEFAULT_ROUNDS,
    GENERATION_EPOCH_KEY,
    ROUNDS,
    JobKeys,
)
from elasticd.rendezvous.leaving import LeavesOnExit, warn_giving_up
from elasticd.rendezvous.rounds import Rules
from elasticd.rendezvous.store import EtcdV3Store
from elasticd.rendezvous.torch_compat import check_torch_apis, supports_cas_backoff

if TYPE_CHECKING:
    from elasticd.rendezvous.companion import RecoveryCompanion


log = structlog.get_logger(__name__)

_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_TIMEOUT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")
_KEEP_ALIVE_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")
_CAS_BACKOFF_KEY = "cas_backoff_max_seconds"  # torch 2.15+
_OWN_KEYS = ("rounds", "recovery", "key_prefix", "ttl", "read_timeout", "retry_timeout",
             "protocol", "ca_cert", "ssl_cert", "ssl_cert_key", "user", "password")
# Keys torchrun itself puts into the config; not ours to judge.
_TORCHRUN_KEYS = ("timeout", "rank", "is_host", "local_addr")
KNOWN_KEYS = frozenset(_OWN_KEYS + _TIMEOUT_KEYS + _KEEP_ALIVE_KEYS + _TORCHRUN_KEYS
                       + (_CAS_BACKOFF_KEY,))

AUTH_STDIN_ENV = "ELASTICD_ETCD_AUTH_STDIN"
USER_ENV = "ELASTICD_ETCD_USER"
PASSWORD_ENV = "ELASTICD_ETCD_PASSWORD"
# How long the agent waits for the daemon's credentials line before giving up.
STDIN_TIMEOUT_S = 10.0
_STDIN_MAX_BYTES = 64 * 1024
# fd 0 can be read once per process: a second handler in the same agent reuses the line.
_stdin_credentials: tuple[str, str] | None = None



@dataclass(frozen=True)
class PluginConfig:
    etcd: EtcdSettings
    keys: JobKeys
    ttl_s: int
    rounds: str = "torch"
    # --rdzv-conf recovery= (the workers' modes). Without it nothing agrees generations (the
    # companion that would is opt-in: its probes and records run in torchrun's agent).
    recovery: RecoveryMode = UNAGREED_RECOVERY


def parse_params(params: RendezvousParameters) -> PluginConfig:
    """Validate ``--rdzv-endpoint``/``--rdzv-conf``; errors name the key and the fix."""
    _warn_unknown(params.config)
    _check_torch_knobs(params)
    endpoints = tuple(e.strip() for e in (params.endpoint or "").split(",") if e.strip())
    if not endpoints:
        raise ConfigError("--rdzv-endpoint is empty; give the etcd endpoints as HOST:PORT[,HOST:PORT]")
    protocol = (params.get("protocol") or "http").strip().lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"rdzv-conf protocol={protocol!r}: use http or https")
    ca_cert = params.get("ca_cert")
    if protocol == "https" and not ca_cert:
        raise ConfigError("rdzv-conf protocol=https needs ca_cert=PATH (the CA of the etcd servers)")
    env_user, env_password = take_credentials()
    settings = EtcdSettings(
        endpoints=endpoints,
        ca_cert=ca_cert,
        cert=params.get("ssl_cert"),
        key=params.get("ssl_cert_key"),
        user=params.get("user") or env_user,
        password=params.get("password") or env_password,
        timeout_s=_positive_int(params, "read_timeout", 5),
        retry_s=_positive_int(params, "retry_timeout", 30),
    )
    keys = JobKeys(params.run_id, params.get("key_prefix") or DEFAULT_ROOT)
    rounds = (params.get("rounds") or DEFAULT_ROUNDS).strip().lower()
    if rounds not in ROUNDS:
        raise ConfigError(f"rdzv-conf rounds={rounds!r}: use keyed (per-agent keys, the "
                          "default) or torch (torch's one shared state)")
    recovery = (params.get("recovery") or UNAGREED_RECOVERY).strip().lower()
    if recovery not in RECOVERY_MODES:
        raise ConfigError(f"rdzv-conf recovery={recovery!r}: use restart (a lost peer restarts "
                          "the workers, the default) or in-place (the survivors re-form their "
                          "group without a restart; needs the trainer library)")
    return PluginConfig(settings, keys, _positive_int(params, "ttl", 7200), rounds,
                        RecoveryMode(recovery))


def take_credentials() -> tuple[str | None, str | None]:
    """The etcd user and password given to this process, removed from where workers see them.

    With ``ELASTICD_ETCD_AUTH_STDIN=1`` they are the one JSON line on fd 0
    (``{"user": ..., "password": ...}``); otherwise ``ELASTICD_ETCD_USER`` /
    ``ELASTICD_ETCD_PASSWORD``. Either way the three variables leave ``os.environ``,
    and fd 0 becomes /dev/null, because torchrun's workers inherit both.
    """
    global _stdin_credentials
    stdin_mode = os.environ.get(AUTH_STDIN_ENV, "") not in ("", "0")
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    for name in (AUTH_STDIN_ENV, USER_ENV, PASSWORD_ENV):
        os.environ.pop(name, None)
    if stdin_mode and _stdin_credentials is None:
        _stdin_credentials = _read_stdin_credentials()
    if _stdin_credentials is not None:
        return _stdin_credentials
    return user, password


def _read_stdin_credentials() -> tuple[str, str]:
    try:
        line = _read_line(0, STDIN_TIMEOUT_S)
    finally:
        # Whatever was read, the workers must not get the pipe (or what is left in it).
        _stdin_to_devnull()
    fix = (f'the daemon must write one line {{"user": "...", "password": "..."}} to the '
           f"agent's stdin when it sets {AUTH_STDIN_ENV}=1")
    try:
        data = json.loads(line)
    except ValueError:
        # Not echoed: the line may well hold the password.
        raise ConfigError(f"{AUTH_STDIN_ENV}=1 but the stdin line is not JSON; {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{AUTH_STDIN_ENV}=1 but the stdin line is not a JSON object; {fix}")
    bad = [f for f in ("user", "password") if not isinstance(data.get(f), str) or not data[f]]
    if bad:
        raise ConfigError(f"{AUTH_STDIN_ENV}=1 but the stdin line lacks {' and '.join(bad)} "
                          f"(non-empty strings); {fix}")
    return data["user"], data["password"]


def _read_line(fd: int, timeout_s: float) -> bytes:
    """One line from ``fd`` (without reading past it), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise ConfigError(f"{AUTH_STDIN_ENV}=1 but no credentials line arrived on stdin "
                                  f"within {timeout_s:.0f} s; the daemon must write it at start")
            chunk = os.read(fd, 1)
            if not chunk:
                break   # EOF: a last line without a newline still counts
            data += chunk
            if len(data) > _STDIN_MAX_BYTES:
                raise ConfigError(f"{AUTH_STDIN_ENV}=1 but the stdin line is over "
                                  f"{_STDIN_MAX_BYTES} bytes; write one short JSON line")
    except OSError as exc:
        raise ConfigError(f"{AUTH_STDIN_ENV}=1 but stdin cannot be read ({exc}); start the "
                          "agent with a pipe on stdin") from None
    if not data.strip():
        raise ConfigError(f"{AUTH_STDIN_ENV}=1 but stdin was empty; the daemon must write "
                          'one line {"user": "...", "password": "..."}')
    return data


def _stdin_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(devnull, 0)
    finally:
        os.close(devnull)


def _positive_int(params: RendezvousParameters, key: str, default: int) -> int:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"rdzv-conf {key}={raw!r} is not a whole number; e.g. {key}={default}") from None
    if value < 1:
        raise ConfigError(f"rdzv-conf {key}={value} must be >= 1; e.g. {key}={default}")
    return value


def _cas_backoff(params: RendezvousParameters) -> float | None:
    raw = params.get(_CAS_BACKOFF_KEY)
    if raw is None or str(raw).strip() == "":
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"rdzv-conf {_CAS_BACKOFF_KEY}={raw!r} must be a number of seconds "
                          f">= 0; e.g. {_CAS_BACKOFF_KEY}=0.5")
    return value


def cas_backoff_kwargs(params: RendezvousParameters) -> dict[str, float]:
    """``from_backend``'s ``cas_backoff_max_seconds`` when set and the installed torch has it
    (2.15+); nothing otherwise (torch's default), with a warning if it was set in vain."""
    value = _cas_backoff(params)
    if value is None:
        return {}
    if not supports_cas_backoff():
        log.warning(f"rdzv-conf {_CAS_BACKOFF_KEY} is ignored: this torch's dynamic rendezvous "
                    "has no compare-and-set backoff (torch >= 2.15 has it)")
        return {}
    return {_CAS_BACKOFF_KEY: value}


def _check_torch_knobs(params: RendezvousParameters) -> None:
    _cas_backoff(params)
    for key in _TIMEOUT_KEYS + _KEEP_ALIVE_KEYS:
        _positive_int(params, key, 1)
    interval = _positive_int(params, "keep_alive_interval", 5)
    attempts = _positive_int(params, "keep_alive_max_attempt", 3)
    if interval * attempts < 3:
        # Measured: 1 s x 2 lets a node evict itself right after joining and a third
        # node then forms a second world beside the first (split brain).
        raise ConfigError(
            f"rdzv-conf keep_alive_interval={interval} x keep_alive_max_attempt={attempts} "
            "evicts live nodes (measured split brain); make the product >= 3 seconds"
        )


def _warn_unknown(config: dict[str, Any]) -> None:
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        log.warning("ignoring unknown rdzv-conf keys", keys=unknown, known=sorted(KNOWN_KEYS))


class EtcdV3RendezvousHandler(LeavesOnExit, dyn.DynamicRendezvousHandler):
    """torch's dynamic rendezvous, made safe against an etcd outage in the steady state.

    The agent's monitor loop polls ``num_nodes_waiting()`` every monitor interval
    and dies on any exception; the heartbeat thread holds the lock that poll
    needs. Both therefore fail fast and count an outage as "no news": training
    goes on while etcd is down, and only membership changes wait for it.
    """

    companion: RecoveryCompanion | None = None   # recovery=in-place (set by create_handler)
    closed_text: str | None = None   # the closed error's text (set by create_handler)

    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        self._leave_if_asked()
        if self.companion is not None:
            self.companion.leave_round()
        self._arm_leave_on_exit()
        try:
            with _woken_by(self):
                return self._next_rendezvous()
        except RendezvousClosedError as exc:
            if self.closed_text is None or str(exc):
                raise
            # torch raises it bare, and torchrun prints it as its last line: say that the run
            # completed and the fix instead (torch's frames below it add nothing).
            raise RendezvousClosedError(self.closed_text) from None

    def _next_rendezvous(self) -> RendezvousInfo:
        info = super().next_rendezvous()
        round_ = self._state_holder.state.round
        export_generation(round_, info, lambda: store_epoch(self._store))
        if self.companion is not None:
            self.companion.on_world(round_, repr(self._this_node))
        return info

    def _backend_waits(self, timeout_s: float) -> None:
        backend = getattr(self._state_holder, "_backend", None)
        if isinstance(backend, CheckedBackend):
            backend.wait_for_change(timeout_s)
            self._state_holder._last_sync_time = -1.0  # the next sync reads, not the cache
        else:
            time.sleep(timeout_s)

    def num_nodes_waiting(self) -> int:
        try:
            with no_retry():
                return super().num_nodes_waiting()
        except (RendezvousConnectionError, EtcdError) as exc:
            log.debug("etcd unreachable; assuming no node is waiting", reason=str(exc))
            return 0

    def _keep_alive(self) -> None:
        with no_retry():
            super()._keep_alive()

    def shutdown(self) -> bool:
        """Close the rendezvous only when this agent's workers succeeded.

        torch's ``launch_agent`` calls ``shutdown()`` in a ``finally`` on every exit but
        a signal: after success, but also after ``--max-restarts`` were used up
        (``ChildFailedError``) or a join timed out (``RendezvousTimeoutError``). torch
        then marks the shared state closed and every other agent fails with
        ``RendezvousClosedError`` from then on. Only the success path reaches that
        ``finally`` with no exception in flight, so that is the one that closes; any
        other shutdown just leaves the rendezvous (stops heartbeats, drops this node
        from the round) and the job goes on without it.
        """
        return self._leave_once(success=sys.exc_info()[1] is None)

    def _leave(self, success: bool) -> bool:
        if self.companion is not None:
            self.companion.stop(done=success)
        if success:
            return super().shutdown()
        self._stop_heartbeats()
        warn_giving_up(self._asked_to_leave, node=repr(self._this_node))
        try:
            with no_retry():
                self._op_executor.run(dyn._RendezvousExitOp(),
                                      self._get_deadline(self._settings.timeout.close))
        except (RendezvousError, EtcdError) as exc:
            # Not fatal: the others evict this node by keep-alive (or the daemon does).
            log.warning("could not leave the rendezvous", reason=str(exc))
        return True


# torch polls the state once a second while a round forms (``_delay(seconds=1)`` in its op
# executor, with a 1 s cache in the state holder): a join waits up to a second per poll
# for news that etcd can push. While this thread runs ``next_rendezvous``, that poll
# waits on a watch of the state key instead and the next sync reads afresh.
_WAKE = threading.local()
_TORCH_DELAY = dyn._delay


def _change_woken_delay(seconds: float | tuple[float, float]) -> None:
    handler = getattr(_WAKE, "handler", None)
    if handler is None or seconds != 1:
        _TORCH_DELAY(seconds)
        return
    handler._backend_waits(1.0)


@contextlib.contextmanager
def _woken_by(handler: EtcdV3RendezvousHandler) -> Iterator[None]:
    _WAKE.handler = handler
    try:
        yield
    finally:
        _WAKE.handler = None


dyn._delay = _change_woken_delay

def export_generation(round_: int, info: RendezvousInfo, epoch: Callable[[], str]) -> None:
    """Export this world's generation to the next workers (both handlers call it).

    ``ELASTICD_GENERATION`` is the round just completed (torch keeps ``round`` at the
    completed round's number and moves it up when the last participant leaves; keyed
    rounds number their worlds in order: a newer world always has a larger one within
    one rendezvous). ``ELASTICD_GENERATION_EPOCH`` names the rendezvous's lifetime
    (``epoch()``): keyed rounds keep one for the job's life (``keyed.epoch``, on no lease,
    as their round numbers are); torch's state, on an agent's lease, restarts at round 0
    when it is created anew, so that layout keeps its epoch in the run's store, on the
    run's lease (``store_epoch``). torchrun builds each worker's environment from a copy
    of ``os.environ`` when it starts the workers, right after the rendezvous returns. The
    checkpoint writer fences commits by them (checkpointing/fence.py).
    """
    try:
        value: str | None = epoch()
    except (RendezvousError, EtcdError, UnicodeDecodeError, RuntimeError) as exc:
        # Still fenced by the round alone; a world of another epoch replaces the fence.
        log.warning("no generation epoch; exporting the round alone", reason=str(exc))
        value = None
    os.environ[GENERATION_ENV] = str(round_)
    if value:
        os.environ[GENERATION_EPOCH_ENV] = value
    else:
        os.environ.pop(GENERATION_EPOCH_ENV, None)
    log.info("rendezvous generation", generation=round_, epoch=value,
             rank=info.rank, world_size=info.world_size)


def store_epoch(store: Any) -> str:
    """torch's layout: the epoch in the run's store, created by the first agent to ask."""
    raw = store.compare_set(GENERATION_EPOCH_KEY, "", uuid.uuid4().hex)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


# The worker-contract variables of WorkerSettings.generation / .generation_epoch.
GENERATION_ENV = "ELASTICD_GENERATION"
GENERATION_EPOCH_ENV = "ELASTICD_GENERATION_EPOCH"
# GENERATION_EPOCH_KEY (keys.py): in the run's store (outside torch's per-round prefixes),
# attached to the agents' lease.


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``torchrun.handlers`` factory: torch's dynamic rendezvous on etcd v3, or keyed
    rounds with ``rounds=keyed``."""
    check_torch_apis()
    config = parse_params(params)
    _use_fresh_bootstrap_store()
    _make_rendezvous_log_visible()
    client = EtcdClient(config.etcd)
    lease = LeaseKeeper(client, config.ttl_s, interval_s=min(config.ttl_s / 3, 10),
                        name="rdzv-run").start()
    store = EtcdV3Store(client, config.keys.store, lease)
    log.info("etcd3 rendezvous backend ready", endpoints=list(config.etcd.endpoints),
             prefix=config.keys.prefix, run_id=params.run_id, rounds=config.rounds)
    timeout = dyn.RendezvousTimeout(*(dyn._get_timeout(params, k.removesuffix("_timeout"))
                                      for k in _TIMEOUT_KEYS))
    interval = _positive_int(params, "keep_alive_interval", 5)
    attempts = _positive_int(params, "keep_alive_max_attempt", 3)
    companion = _companion(config, client, params.local_addr, interval, attempts)
    if config.rounds == "keyed":
        keyed: KeyedRendezvousHandler = KeyedRendezvousHandler(
            params.run_id, client, config.keys, store, lease,
            Rules(params.min_nodes, params.max_nodes, timeout.last_call.total_seconds()),
            params.local_addr, join_timeout_s=timeout.join.total_seconds(),
            keep_alive_interval_s=interval, keep_alive_max_attempt=attempts,
            on_world=lambda round_, info: export_generation(round_, info, keyed.epoch),
            companion=companion)
        return keyed
    backend = CheckedBackend(EtcdV3RendezvousBackend(client, config.keys.rdzv_state, lease))
    handler = EtcdV3RendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        timeout, keep_alive_interval=interval, keep_alive_max_attempt=attempts,
        **cas_backoff_kwargs(params),
    )
    handler.companion = companion
    handler.closed_text = closed_message(params.run_id, config.keys, config.etcd, config.ttl_s)
    return handler


def _companion(config: PluginConfig, client: EtcdClient, local_addr: str | None,
               interval_s: int, attempts: int) -> RecoveryCompanion | None:
    """The agent's in-place recovery companion with ``recovery=in-place``, else None."""
    if config.recovery != IN_PLACE:
        return None
    if os.environ.get(DAEMON_PID_ENV):
        log.warning("rdzv-conf recovery=in-place is ignored under the elasticd daemon: the "
                    "daemon agrees the generations itself ([recovery] mode)")
        return None
    # Imported here: at import time the companion's imports (observer, admin) import torch's
    # rendezvous, whose registry imports this plugin while they are half-initialised (an
    # ImportError traceback in every daemon's log, seen in CI).
    from elasticd.rendezvous.companion import RecoveryCompanion

    # The address peers reach this agent at: torch's own choice for MASTER_ADDR.
    addr = local_addr or socket.getfqdn()
    return RecoveryCompanion(client, config.keys, addr, interval_s * attempts,
                             interval_s).start()


def _use_fresh_bootstrap_store() -> None:
    """Publish MASTER_ADDR/PORT anew every round.

    With the agent's shared TCPStore (torch's default) a node that stays rank 0
    never republishes them under the new round's prefix, and a survivor reuses a
    dead master's port: 5 of 8 forced restarts failed here; 8 of 8 passed without.
    """
    if os.environ.get(_SHARE_STORE_ENV, "1") != "1":
        log.warning(f"{_SHARE_STORE_ENV}=0 is unreliable across restarts; forcing 1")
    os.environ[_SHARE_STORE_ENV] = "1"


def _make_rendezvous_log_visible() -> None:
    # torch's dynamic_rendezvous logger has no handler: its "joined round" lines
    # would be invisible under LOGLEVEL=INFO.
    logger = logging.getLogger(dyn.__name__)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
