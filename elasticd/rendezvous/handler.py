"""Build torch's dynamic rendezvous handler on the etcd v3 backend and store.

``--rdzv-conf`` keys (all optional)::

    key_prefix=/elasticd        root of the job's keys (<key_prefix>/<run_id>/rdzv/...)
    ttl=7200                    seconds the run's keys outlive the last live agent
    read_timeout=5              seconds per etcd request
    retry_timeout=30            seconds an etcd outage is retried before an error
    protocol=http|https         https needs ca_cert
    ca_cert=, ssl_cert=, ssl_cert_key=    TLS files (PEM)
    user=, password=            etcd auth; or ELASTICD_ETCD_USER / ELASTICD_ETCD_PASSWORD
    join_timeout, last_call_timeout, close_timeout, heartbeat_timeout,
    keep_alive_interval, keep_alive_max_attempt    torch's dynamic rendezvous knobs

``--rdzv-endpoint`` takes one or more ``HOST:PORT`` separated by commas.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn

from elasticd.errors import ConfigError, EtcdError
from elasticd.etcd_client import EtcdClient, EtcdSettings, no_retry
from elasticd.lease import LeaseKeeper
from elasticd.rendezvous.backend import EtcdV3RendezvousBackend
from elasticd.rendezvous.keys import DEFAULT_ROOT, JobKeys
from elasticd.rendezvous.store import EtcdV3Store

log = structlog.get_logger(__name__)

_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_TIMEOUT_KEYS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout")
_KEEP_ALIVE_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")
_OWN_KEYS = ("key_prefix", "ttl", "read_timeout", "retry_timeout", "protocol", "ca_cert",
             "ssl_cert", "ssl_cert_key", "user", "password")
# Keys torchrun itself puts into the config; not ours to judge.
_TORCHRUN_KEYS = ("timeout", "rank", "is_host", "local_addr")
KNOWN_KEYS = frozenset(_OWN_KEYS + _TIMEOUT_KEYS + _KEEP_ALIVE_KEYS + _TORCHRUN_KEYS)


@dataclass(frozen=True)
class PluginConfig:
    etcd: EtcdSettings
    keys: JobKeys
    ttl_s: int


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
    settings = EtcdSettings(
        endpoints=endpoints,
        ca_cert=ca_cert,
        cert=params.get("ssl_cert"),
        key=params.get("ssl_cert_key"),
        user=params.get("user") or os.environ.get("ELASTICD_ETCD_USER"),
        password=params.get("password") or os.environ.get("ELASTICD_ETCD_PASSWORD"),
        timeout_s=_positive_int(params, "read_timeout", 5),
        retry_s=_positive_int(params, "retry_timeout", 30),
    )
    keys = JobKeys(params.run_id, params.get("key_prefix") or DEFAULT_ROOT)
    return PluginConfig(settings, keys, _positive_int(params, "ttl", 7200))


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


def _check_torch_knobs(params: RendezvousParameters) -> None:
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


class EtcdV3RendezvousHandler(dyn.DynamicRendezvousHandler):
    """torch's dynamic rendezvous, made safe against an etcd outage in the steady state.

    The agent's monitor loop polls ``num_nodes_waiting()`` every monitor interval
    and dies on any exception; the heartbeat thread holds the lock that poll
    needs. Both therefore fail fast and count an outage as "no news": training
    goes on while etcd is down, and only membership changes wait for it.
    """

    @property
    def use_agent_store(self) -> bool:
        return False

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


def create_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """The ``torchrun.handlers`` factory: a dynamic rendezvous handler on etcd v3."""
    config = parse_params(params)
    _use_fresh_bootstrap_store()
    _make_rendezvous_log_visible()
    client = EtcdClient(config.etcd)
    lease = LeaseKeeper(client, config.ttl_s, interval_s=min(config.ttl_s / 3, 10),
                        name="rdzv-run").start()
    backend = EtcdV3RendezvousBackend(client, config.keys.rdzv_state, lease)
    store = EtcdV3Store(client, config.keys.store, lease)
    log.info("etcd3 rendezvous backend ready", endpoints=list(config.etcd.endpoints),
             prefix=config.keys.prefix, run_id=params.run_id)
    timeout = dyn.RendezvousTimeout(*(dyn._get_timeout(params, k.removesuffix("_timeout"))
                                      for k in _TIMEOUT_KEYS))
    return EtcdV3RendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        timeout,
        keep_alive_interval=_positive_int(params, "keep_alive_interval", 5),
        keep_alive_max_attempt=_positive_int(params, "keep_alive_max_attempt", 3),
    )


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
