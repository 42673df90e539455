"""The one adapter between elasticd and the etcd v3 client library.

Everything elasticd does with etcd goes through ``EtcdClient``; it is the only
module that imports ``etcd3`` or ``grpc``, and the only place their exceptions
are translated (to ``EtcdUnavailable``, ``EtcdAuthError``, ``EtcdError``).
Swapping the client library means rewriting this file alone.

Retries: transient unavailability (no endpoint answers, a deadline passes) is
retried with exponential backoff and jitter for at most ``retry_s`` seconds,
then raised. A compare-and-set whose response was lost may be retried and then
report a lost race although it won; callers re-read state after a lost race,
which is what torch's rendezvous and our store do.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import etcd3
import etcd3.events
import etcd3.exceptions as etcd_exc
import etcd3.watch
import grpc
import structlog
import tenacity
from etcd3 import utils as etcd_utils
from etcd3.client import EtcdTokenCallCredentials

from elasticd.errors import ConfigError, EtcdAuthError, EtcdError, EtcdUnavailable

log = structlog.get_logger(__name__)

DEFAULT_PORT = 2379
# A failed endpoint is skipped for this long before it is tried again. The client
# library's default (300 s) would turn a 2-second etcd restart into a 5-minute outage.
_ENDPOINT_RETRY_S = 0.5


# python3-etcd3 0.13's watch thread calls ``six.itervalues`` when a stream ends
# without importing six: the NameError kills the thread before the callbacks hear
# of the broken stream (after an etcd restart, say). Give it what it calls.
if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = type("six", (), {"itervalues": staticmethod(lambda d: iter(d.values()))})

_NO_RETRY: contextvars.ContextVar[bool] = contextvars.ContextVar("elasticd_etcd_no_retry",
                                                                default=False)
# Monotonic time by which every etcd call of this thread must be over (see ``deadline``).
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("elasticd_etcd_deadline",
                                                                        default=None)
# An attempt never gets less than this: a shorter grpc deadline could fail a healthy call.
_MIN_ATTEMPT_S = 0.05
# What an etcd member answers (code UNKNOWN) when its own proposal deadline passes.
_SERVER_TIMEOUT = "context deadline exceeded"


@contextmanager
def no_retry() -> Iterator[None]:
    """Within this block, etcd calls of this thread fail at once instead of retrying.

    For callers on a hot path that must never wait out an etcd outage (the
    agent's monitor loop, heartbeats): they treat an error as "no news".
    """
    token = _NO_RETRY.set(True)
    try:
        yield
    finally:
        _NO_RETRY.reset(token)


@contextmanager
def deadline(seconds: float, clock: Callable[[], float] = time.monotonic) -> Iterator[None]:
    """Within this block, etcd calls of this thread end by ``clock() + seconds``.

    Each attempt's grpc timeout is cut to the time left, retries stop at the
    deadline, and a call made after it raises ``EtcdUnavailable`` at once. The
    daemon's loop runs each cycle inside one, so a frozen etcd (whose kernel still
    accepts connections) never holds a cycle past its budget. Nested blocks keep
    the earlier deadline.
    """
    until = clock() + seconds
    outer = _DEADLINE.get()
    token = _DEADLINE.set(until if outer is None else min(until, outer))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _time_left() -> float | None:
    until = _DEADLINE.get()
    return None if until is None else until - time.monotonic()


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host[:port]`` or ``http(s)://host[:port]`` -> (host, port); a clear error otherwise."""
    raw = text.strip()
    for scheme in ("http://", "https://"):
        if raw.startswith(scheme):
            raw = raw[len(scheme):]
    raw = raw.rstrip("/")
    if "/" in raw:
        raise ConfigError(f"etcd endpoint {text!r} has a path; write it as HOST:PORT, e.g. 127.0.0.1:2379")
    if not raw:
        raise ConfigError(f"etcd endpoint {text!r} is empty; write it as HOST:PORT, e.g. 127.0.0.1:2379")
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        return raw, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            f"etcd endpoint {text!r} has a bad port {port_text!r}; write it as HOST:PORT, "
            "e.g. 127.0.0.1:2379"
        )
    return host.strip("[]"), int(port_text)


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd. Validated on construction; errors name the field and the fix."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout_s: float = 5.0
    retry_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd endpoints is empty; give at least one HOST:PORT")
        for endpoint in self.endpoints:
            parse_endpoint(endpoint)
            if endpoint.strip().startswith("https://") and self.ca_cert is None:
                # Stripping the scheme and connecting in plaintext would send the
                # password in the clear to whoever answers.
                raise ConfigError(f"etcd endpoint {endpoint!r} asks for TLS but ca_cert is not set; "
                                  "set ca_cert (the CA that signed the etcd servers) or use http://")
            if endpoint.strip().startswith("http://") and self.ca_cert is not None:
                raise ConfigError(f"etcd endpoint {endpoint!r} says plaintext but ca_cert is set; "
                                  "use https:// or HOST:PORT")
        if (self.cert is None) != (self.key is None):
            raise ConfigError("etcd TLS: set both cert and key (client certificate and its key), or neither")
        if self.cert is not None and self.ca_cert is None:
            raise ConfigError("etcd TLS: a client cert needs ca_cert (the CA that signed the server)")
        for name in ("ca_cert", "cert", "key"):
            _check_readable(name, getattr(self, name))
        if (self.user is None) != (self.password is None):
            raise ConfigError("etcd auth: set both user and password, or neither")
        if self.timeout_s <= 0:
            raise ConfigError(f"etcd timeout_s={self.timeout_s} must be > 0 seconds")
        if self.retry_s < 0:
            raise ConfigError(f"etcd retry_s={self.retry_s} must be >= 0 seconds")

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None

    def describe(self) -> str:
        return ", ".join(self.endpoints)


def _check_readable(name: str, path: str | None) -> None:
    if path is None:
        return
    if not os.path.isfile(path):
        raise ConfigError(f"etcd TLS {name}={path!r}: no such file; give the path of a PEM file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"etcd TLS {name}={path!r} is not readable by this user; fix its permissions")


@dataclass(frozen=True)
class KeyValue:
    """One etcd key as read: its value and the revisions that fence writes to it."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease_id: int


class _DeadlineClient(etcd3.MultiEndpointEtcd3Client):
    """The library's client, whose per-call timeout honours this thread's ``deadline``.

    The library reads ``self.timeout`` at every call; a property reading a context
    variable makes that per thread, so one client serves every thread.
    """

    @property
    def timeout(self) -> float | None:
        left = _time_left()
        if left is None:
            return self._base_timeout
        return max(min(self._base_timeout or left, left), _MIN_ATTEMPT_S)

    @timeout.setter
    def timeout(self, value: float | None) -> None:
        self._base_timeout = value

    def get_watcher(self) -> Any:
        # A watcher lives on after the call that created it: never give it a
        # cycle's short deadline.
        token = _DEADLINE.set(None)
        try:
            return super().get_watcher()
        finally:
            _DEADLINE.reset(token)


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch: ``deleted`` or put with its new ``value``."""

    key: str
    value: bytes
    mod_revision: int
    deleted: bool


def _watch_event(event: Any) -> WatchEvent:
    return WatchEvent(event.key.decode(), bytes(event.value), int(event.mod_revision),
                      isinstance(event, etcd3.events.DeleteEvent))


class EtcdClient:
    """A small, typed, exception-translating view of an etcd v3 cluster."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client = self._with_retry(self._connect)

    # -- connection and error translation -------------------------------------------

    def _connect(self) -> Any:
        creds = _tls_credentials(self.settings)
        endpoints = [
            etcd3.Endpoint(*parse_endpoint(e), secure=self.settings.secure, creds=creds,
                           time_retry=_ENDPOINT_RETRY_S)
            for e in self.settings.endpoints
        ]
        if self.settings.user is not None and not self.settings.secure:
            log.warning("etcd user/password over plaintext: anyone on the path can read them; "
                        "set ca_cert (TLS) in production", endpoints=self.settings.describe())
        with self._translated():
            client = _DeadlineClient(
                endpoints=endpoints, timeout=self.settings.timeout_s,
                user=self.settings.user, password=self.settings.password, failover=True,
            )
        if not self.settings.secure:
            # grpc refuses call credentials on a plaintext channel; the auth token
            # also travels in the request metadata, which is all etcd reads.
            client.call_credentials = None
        return client

    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                etcd_exc.NoServerAvailableError) as exc:
            raise EtcdUnavailable(self._unavailable_message(exc)) from exc
        except etcd_exc.Etcd3Exception as exc:
            raise EtcdError(f"etcd error: {type(exc).__name__}: {exc}") from exc
        except grpc.RpcError as exc:
            raise self._translate_rpc(exc) from exc
        except ValueError as exc:
            # The client raises ValueError when every endpoint is marked failed, and
            # grpc when a channel was closed under a call (client shutdown).
            text = str(exc).lower()
            if "failed" in text or "endpoint" in text or "closed channel" in text:
                raise EtcdUnavailable(self._unavailable_message(exc)) from exc
            raise

    def _unavailable_message(self, exc: BaseException) -> str:
        detail = str(exc) or type(exc).__name__
        return f"no etcd endpoint answered (tried {self.settings.describe()}): {detail}"

    def _translate_rpc(self, exc: grpc.RpcError) -> EtcdError:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            return EtcdAuthError(
                f"etcd rejected the credentials ({details}); check user/password and the "
                f"role's permissions on this prefix (endpoints {self.settings.describe()})"
            )
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return EtcdUnavailable(self._unavailable_message(exc))
        if code == grpc.StatusCode.UNKNOWN and _SERVER_TIMEOUT in (details or ""):
            # A member without quorum times the proposal out itself and answers UNKNOWN
            # "context deadline exceeded" (seen on etcd 3.5 with two of three members down):
            # the cluster is unavailable, not the request wrong.
            return EtcdUnavailable(self._unavailable_message(exc))
        if code == grpc.StatusCode.INVALID_ARGUMENT and any(
                word in (details or "") for word in ("authentication", "user name", "token")):
            return EtcdAuthError(
                f"etcd rejected the credentials ({details}); check user and password "
                f"(endpoints {self.settings.describe()})"
            )
        return EtcdError(f"etcd error {code}: {details}")

    def _with_retry(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, retrying transient unavailability for at most ``retry_s`` seconds
        (and never past this thread's ``deadline``)."""
        budget = 0.0 if _NO_RETRY.get() else self.settings.retry_s
        left = _time_left()
        if left is not None:
            if left <= 0:
                raise EtcdUnavailable(f"the caller's etcd deadline passed (endpoints "
                                      f"{self.settings.describe()})")
            budget = min(budget, left)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(EtcdUnavailable),
            wait=tenacity.wait_exponential_jitter(multiplier=0.05, max=1.0, jitter=0.1),
            stop=tenacity.stop_after_delay(budget),
            reraise=True,
        )
        return retrying(fn)

    def _call(self, op: Callable[[Any], Any]) -> Any:
        def attempt() -> Any:
            try:
                with self._translated():
                    return op(self._client)
            except EtcdAuthError:
                # An etcd restart invalidates simple auth tokens: authenticate again once.
                if self.settings.user is None:
                    raise
                self._authenticate()
                with self._translated():
                    return op(self._client)
        return self._with_retry(attempt)

    def _authenticate(self) -> None:
        """Get a fresh auth token on the same client.

        Replacing (and closing) the client here would pull the channel from under
        other threads' calls ("Cannot invoke RPC on closed channel").
        """
        with self._lock, self._translated():
            client = self._client
            response = client.authstub.Authenticate(
                etcd3.etcdrpc.AuthenticateRequest(name=self.settings.user,
                                                  password=self.settings.password),
                client.timeout)
            client.metadata = (("token", response.token),)
            if self.settings.secure:
                client.call_credentials = grpc.metadata_call_credentials(
                    EtcdTokenCallCredentials(response.token))
            # The cached watcher holds the old token: new watches get a new one.
            old_watcher = client._stubs.pop("watcher", None)
        if old_watcher is not None:
            with contextlib.suppress(Exception):
                old_watcher.close()

    def close(self) -> None:
        self._client.close()

    # -- key/value ---------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call(lambda c: c.get(key))
        return None if value is None else _kv(value, meta)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [_kv(v, m) for v, m in self._call(lambda c: list(c.get_prefix(prefix)))]

    def list_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Keys under ``prefix`` and the revision they were read at (to watch from)."""
        response = self._call(lambda c: c.get_prefix_response(prefix))
        kvs = [KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision, kv.lease)
               for kv in response.kvs]
        return kvs, int(response.header.revision)

    def count_prefix(self, prefix: str) -> int:
        """How many keys are under ``prefix`` (etcd counts; no values travel)."""
        return int(self._call(lambda c: c.get_prefix_response(prefix, count_only=True)).count)

    def first_key(self, start: str, end: str) -> str | None:
        """The smallest key in ``[start, end)``, if any (one key, no value travels)."""
        response = self._call(lambda c: c.get_range_response(start, end, limit=1, keys_only=True))
        return next((kv.key.decode() for kv in response.kvs), None)

    def first_created(self, prefix: str) -> KeyValue | None:
        """The key under ``prefix`` with the lowest create revision (the oldest), if any."""
        response = self._call(lambda c: c.get_prefix_response(
            prefix, limit=1, sort_order="ascend", sort_target="create"))
        return next((KeyValue(kv.key.decode(), kv.value, kv.mod_revision, kv.create_revision,
                              kv.lease) for kv in response.kvs), None)

    def create_all(self, creates: dict[str, tuple[bytes, int | None]], first: str,
                   deletes: tuple[str, ...] = (), unchanged: dict[str, int] | None = None) -> bool:
        """Put every key of ``creates`` (value, lease) and delete ``deletes``, in one
        transaction, only if ``first`` does not exist yet and every key of ``unchanged``
        still has that mod revision (0: still absent); True if this call wrote."""
        fences = [_tx().mod(k) == rev for k, rev in (unchanged or {}).items()]
        ok, _ = self._txn([_tx().create(first) == 0, *fences],
                          [_tx_put(k, v, lease) for k, (v, lease) in creates.items()]
                          + [_tx().delete(k) for k in deletes], [])
        return bool(ok)

    def get_many(self, keys: list[str]) -> tuple[dict[str, KeyValue], int]:
        """The given keys (absent ones omitted) and the revision read at.

        Atomic up to ``MAX_TXN_OPS`` keys (etcd refuses larger transactions: "too many
        operations in txn request", its ``--max-txn-ops`` default); more are read in
        chunks, and the revision is the first chunk's, so a watch from it misses no
        write made while the later chunks were read.
        """
        if len(keys) > MAX_TXN_OPS:
            found: dict[str, KeyValue] = {}
            first: int | None = None
            for start in range(0, len(keys), MAX_TXN_OPS):
                part, revision = self.get_many(keys[start:start + MAX_TXN_OPS])
                found.update(part)
                first = revision if first is None else first
            return found, int(first or 0)
        return self._get_atomic(keys)

    def _get_atomic(self, keys: list[str]) -> tuple[dict[str, KeyValue], int]:
        def op(c: Any) -> tuple[dict[str, KeyValue], int]:
            response = c.kvstub.Txn(
                etcd3.etcdrpc.TxnRequest(success=[
                    etcd3.etcdrpc.RequestOp(request_range=c._build_get_range_request(k))
                    for k in keys
                ]),
                c.timeout, credentials=c.call_credentials, metadata=c.metadata,
            )
            found = {}
            for item in response.responses:
                for kv in item.response_range.kvs:
                    found[kv.key.decode()] = KeyValue(kv.key.decode(), kv.value, kv.mod_revision,
                                                      kv.create_revision, kv.lease)
            return found, response.header.revision
        return self._call(op)

    def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        self._call(lambda c: c.put(key, value, lease=lease))

    def put_or_create(self, key: str, value: bytes, expected: int | None,
                      lease: int | None = None) -> tuple[bool, KeyValue | None]:
        """Compare-and-set fenced on the key's mod_revision.

        ``expected=None`` means "only if absent". Returns ``(True, written)`` with
        the new revisions when this call wrote, else ``(False, current)`` where
        ``current`` is the value that won (None if the key does not exist).
        """
        compare = [_tx().create(key) == 0] if expected is None else [_tx().mod(key) == expected]
        ok, responses = self._txn(compare, [_tx_put(key, value, lease)], [_tx().get(key)])
        if ok:
            revision = responses[0].response_put.header.revision
            create = revision if expected is None else 0
            return True, KeyValue(key, value, revision, create, lease or 0)
        current = responses[0] if responses else []
        return False, (_kv(*current[0]) if current else None)

    def delete(self, key: str) -> bool:
        return bool(self._call(lambda c: c.delete(key)))

    def delete_if_revision(self, key: str, mod_revision: int) -> bool:
        ok, _ = self._txn([_tx().mod(key) == mod_revision], [_tx().delete(key)], [])
        return ok

    def _txn(self, compare: list, success: list, failure: list) -> tuple[bool, list]:
        return self._call(lambda c: c.transaction(compare=compare, success=success, failure=failure))

    # -- leases --------------------------------------------------------------------------

    def grant_lease(self, ttl_s: int) -> int:
        return int(self._call(lambda c: c.lease(int(ttl_s))).id)

    def refresh_lease(self, lease_id: int) -> int:
        """Keep the lease alive; returns its remaining TTL, 0 if it no longer exists."""
        responses = self._call(lambda c: list(c.refresh_lease(lease_id)))
        return max((int(r.TTL) for r in responses), default=0)

    def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease (-1 if it does not exist)."""
        return int(self._call(lambda c: c.get_lease_info(lease_id)).TTL)

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._call(lambda c: c.revoke_lease(lease_id))
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    # -- watches -------------------------------------------------------------------------

    def wait_for_change(self, prefix: str, after_revision: int, timeout_s: float,
                        exact: bool = False) -> bool:
        """Block until a key under ``prefix`` (the key ``prefix`` itself if ``exact``)
        changes after ``after_revision`` or timeout.

        Returns True if a change was seen. A broken watch stream returns False
        early; callers re-read state, so that only costs one poll.
        """
        events: queue.Queue = queue.Queue()
        range_end = None if exact else etcd_utils.prefix_range_end(etcd_utils.to_bytes(prefix))
        watch_id = self._call(lambda c: c.add_watch_callback(
            prefix, events.put, range_end=range_end, start_revision=after_revision + 1))
        try:
            item = events.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return False
        finally:
            self._cancel_watch(watch_id)
        return not isinstance(item, Exception)

    def watch_prefix(self, prefix: str, callback: Callable[[list[WatchEvent] | EtcdError], None],
                     start_revision: int | None = None) -> Callable[[], None]:
        """Call ``callback`` with each batch of ``WatchEvent`` under ``prefix``, or with an
        ``EtcdError`` when the stream broke (the watch is then dead: re-list and watch again).

        Returns a function that cancels the watch. The callback runs on the
        client's watch thread: keep it short.
        """
        range_end = etcd_utils.prefix_range_end(etcd_utils.to_bytes(prefix))
        kwargs: dict[str, Any] = {"range_end": range_end}
        if start_revision is not None:
            kwargs["start_revision"] = start_revision

        def typed(response: Any) -> None:
            if isinstance(response, Exception):
                callback(EtcdUnavailable(f"etcd watch on {prefix} broke: {response!r}"))
                return
            callback([_watch_event(e) for e in response.events])

        watch_id = self._call(lambda c: c.add_watch_callback(prefix, typed, **kwargs))
        return lambda: self._cancel_watch(watch_id)

    def _cancel_watch(self, watch_id: Any) -> None:
        try:
            with self._translated():
                self._client.cancel_watch(watch_id)
        except EtcdError:
            pass  # the stream is gone already: nothing is left to cancel


# etcd's default ``--max-txn-ops``: the most operations one transaction may hold.
MAX_TXN_OPS = 128


def _tx() -> Any:
    return etcd3.Transactions()


def _tx_put(key: str, value: bytes, lease: int | None) -> Any:
    return _tx().put(key, value, lease=lease)


def _kv(value: bytes, meta: Any) -> KeyValue:
    return KeyValue(meta.key.decode(), value, meta.mod_revision, meta.create_revision,
                    meta.lease_id)


def _tls_credentials(settings: EtcdSettings) -> grpc.ChannelCredentials | None:
    if not settings.secure:
        return None
    try:
        return etcd3.MultiEndpointEtcd3Client.get_secure_creds(
            settings.ca_cert, settings.key, settings.cert)
    except OSError as exc:
        raise ConfigError(f"etcd TLS files could not be read: {exc}") from exc
