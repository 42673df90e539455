"""Cloud preemption notices: poll the instance metadata service, start the drain once.

Preemptible nodes are warned before they are taken: AWS spot gives about two
minutes (``spot/instance-action``), GCE and Azure about 30 s (``preempted``,
scheduled event ``Preempt``). A ``PreemptionWatcher`` polls every enabled
provider and calls the daemon's ``on_notice`` exactly once, with the first
notice seen; then it stops polling, since the node is going away either way.

Contracts:

* An unreachable, slow or erroring metadata service is never a notice. It is
  logged once when a provider starts failing and once when it answers again,
  and polling goes on.
* Only the standard library talks HTTP. Proxies from the environment are
  ignored and redirects refused: the metadata service is link-local, and a
  proxy (``http_proxy`` set for pip, say) must never see or answer these requests.
* Each provider's ``check()`` is one poll: it returns a ``Notice`` or ``None``,
  or raises ``MetadataError``; third-party errors (urllib, sockets, JSON) are
  translated to ``MetadataError`` here and nowhere else.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Protocol

import structlog

from elasticd.errors import ConfigError, ElasticdError

log = structlog.get_logger(__name__)

GCE_METADATA_URL = "http://metadata.google.internal"
AWS_METADATA_URL = "http://169.254.169.254"
AZURE_METADATA_URL = "http://169.254.169.254"

# GCE's notice is the start of a fixed window; the server reports no time.
GCE_NOTICE_WINDOW_S = 30.0
AWS_TOKEN_TTL_S = 21600  # the IMDSv2 maximum (6 h)
AZURE_EVENTS_API = "2020-07-01"
AZURE_INSTANCE_API = "2021-02-01"
AZURE_PREEMPT_TYPES = frozenset({"Preempt", "Terminate"})

# A poll slower than the shortest notice window (GCE, Azure: 30 s) would miss it.
_MAX_POLL_INTERVAL_S = 30.0
_MAX_BODY_BYTES = 64 * 1024


class MetadataError(ElasticdError):
    """The metadata service did not give a usable answer (network, HTTP status, body)."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice.

    ``deadline_s`` is the number of seconds left, when the notice was read,
    before the instance is taken (``None`` when the provider does not say);
    ``on_notice`` runs right after the read, so ``clock() + deadline_s`` in the
    callback is the drain deadline. ``raw`` is the service's answer, for logs.
    """

    provider: str
    reason: str
    deadline_s: float | None
    raw: str


@dataclass(frozen=True)
class PreemptionConfig:
    """Which providers to watch and how; validated on construction (``ConfigError``)."""

    gce: bool = False
    aws: bool = False
    azure: bool = False
    metadata_url: str | None = None
    poll_interval_s: float = 1.0
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        for key in ("gce", "aws", "azure"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"preemption.{key}={getattr(self, key)!r} must be true or false "
                                  "(a boolean, not a string)")
        _check_seconds("poll_interval_s", self.poll_interval_s, upper=_MAX_POLL_INTERVAL_S)
        _check_seconds("timeout_s", self.timeout_s)
        _check_url(self.metadata_url)

    @property
    def enabled(self) -> bool:
        """True when at least one provider is watched."""
        return self.gce or self.aws or self.azure

    def base_url(self, default: str) -> str:
        """``metadata_url`` if set (without a trailing slash), else the provider's ``default``."""
        return (self.metadata_url or default).rstrip("/")


def _check_seconds(key: str, value: object, *, upper: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"preemption.{key}={value!r} must be a number of seconds > 0")
    if value <= 0:
        raise ConfigError(f"preemption.{key}={value!r} must be > 0; use e.g. 1.0")
    if upper is not None and value > upper:
        raise ConfigError(f"preemption.{key}={value!r} must be <= {upper:g}: GCE and Azure give "
                          f"only about 30 s of notice; use e.g. 1.0")


def _check_url(url: object) -> None:
    if url is None:
        return
    if not isinstance(url, str) or not url.startswith("http://") or len(url.rstrip("/")) <= 7:
        raise ConfigError(f"preemption.metadata_url={url!r} must start with http:// and name a host "
                          "(metadata services speak plain HTTP), e.g. http://169.254.169.254; "
                          "leave it unset for the provider's default")


# -- HTTP, the one adapter boundary -------------------------------------------------------------

class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Metadata services never redirect; following one could leave the link-local network."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


# No ProxyHandler entries: environment proxies must not carry metadata requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


@dataclass(frozen=True)
class _Response:
    status: int
    body: str


def _http(method: str, url: str, headers: Mapping[str, str], timeout_s: float) -> _Response:
    """One request; any HTTP status is a ``_Response``, anything else a ``MetadataError``."""
    data = b"" if method == "PUT" else None
    req = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            return _Response(resp.status, _read(resp))
    except urllib.error.HTTPError as err:
        with contextlib.closing(err):
            return _Response(err.code, _read(err))
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as err:
        # URLError wraps refused/unreachable/DNS; OSError covers timeouts; HTTPException
        # a connection cut mid-answer; ValueError a malformed URL.
        raise MetadataError(f"{method} {url}: {_reason(err)}") from err


def _read(resp) -> str:
    try:
        return resp.read(_MAX_BODY_BYTES).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException) as err:
        raise MetadataError(f"reading the answer failed: {_reason(err)}") from err


def _reason(err: BaseException) -> str:
    reason = getattr(err, "reason", None) or err
    return f"{type(reason).__name__}: {reason}"


def _unexpected(resp: _Response, url: str) -> MetadataError:
    return MetadataError(f"GET {url}: HTTP {resp.status}: {resp.body[:200]!r}")


# -- providers ----------------------------------------------------------------------------------

class Provider(Protocol):
    name: str

    def check(self) -> Notice | None:
        """One poll: a ``Notice``, ``None`` (no notice), or raise ``MetadataError``."""
        ...


class GceProvider:
    """GCE (and GCE spot): ``instance/preempted`` reads ``TRUE`` once the VM is preempted."""

    name = "gce"

    def __init__(self, base_url: str = GCE_METADATA_URL, *, timeout_s: float = 1.0) -> None:
        self.url = f"{base_url.rstrip('/')}/computeMetadata/v1/instance/preempted"
        self.timeout_s = timeout_s

    def check(self) -> Notice | None:
        resp = _http("GET", self.url, {"Metadata-Flavor": "Google"}, self.timeout_s)
        if resp.status != 200:
            raise _unexpected(resp, self.url)
        if resp.body.strip().upper() != "TRUE":
            return None
        return Notice(self.name, "preempted", GCE_NOTICE_WINDOW_S, resp.body)


class AwsProvider:
    """AWS spot over IMDSv2: a session token, then ``spot/instance-action`` (404 = none).

    The token is cached and renewed a minute (or a tenth of its TTL) before it
    expires, by ``clock``; a 401 (token revoked, or expired early) renews it
    once and retries. ``wall_clock`` only converts the notice's UTC time.
    """

    name = "aws"

    def __init__(self, base_url: str = AWS_METADATA_URL, *, timeout_s: float = 1.0,
                 token_ttl_s: int = AWS_TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if not 1 <= token_ttl_s <= AWS_TOKEN_TTL_S:
            raise ConfigError(f"aws token_ttl_s={token_ttl_s} must be in 1..{AWS_TOKEN_TTL_S}")
        base = base_url.rstrip("/")
        self.token_url = f"{base}/latest/api/token"
        self.action_url = f"{base}/latest/meta-data/spot/instance-action"
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._token: str | None = None
        self._token_renew_at = 0.0

    def check(self) -> Notice | None:
        resp = self._get_action(self._current_token())
        if resp.status == 401:
            self._token = None
            resp = self._get_action(self._current_token())
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise _unexpected(resp, self.action_url)
        return self._notice(resp.body)

    def _get_action(self, token: str) -> _Response:
        return _http("GET", self.action_url, {"X-aws-ec2-metadata-token": token}, self.timeout_s)

    def _current_token(self) -> str:
        if self._token is None or self._clock() >= self._token_renew_at:
            self._token = self._fetch_token()
            margin = min(60.0, self.token_ttl_s / 10)
            self._token_renew_at = self._clock() + self.token_ttl_s - margin
        return self._token

    def _fetch_token(self) -> str:
        headers = {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)}
        resp = _http("PUT", self.token_url, headers, self.timeout_s)
        if resp.status != 200 or not resp.body.strip():
            raise MetadataError(f"PUT {self.token_url}: HTTP {resp.status}: {resp.body[:200]!r}")
        return resp.body.strip()

    def _notice(self, body: str) -> Notice:
        # A 200 here means an action is scheduled, even if the body cannot be parsed.
        try:
            doc = json.loads(body)
        except ValueError:
            doc = {}
        doc = doc if isinstance(doc, dict) else {}
        deadline = _seconds_until(_parse_iso(doc.get("time")), self._wall_clock)
        return Notice(self.name, f"spot-{doc.get('action', 'unknown')}", deadline, body)


class AzureProvider:
    """Azure: a ``Preempt`` (spot eviction) or ``Terminate`` scheduled event for this VM.

    Scheduled events go to every VM of an availability set or scale-set
    placement group, so an event counts only if its ``Resources`` name this VM
    (``compute/name``, fetched once, when the first candidate event shows up)
    or name nobody.
    """

    name = "azure"

    def __init__(self, base_url: str = AZURE_METADATA_URL, *, timeout_s: float = 1.0,
                 wall_clock: Callable[[], float] = time.time) -> None:
        base = base_url.rstrip("/")
        self.events_url = f"{base}/metadata/scheduledevents?api-version={AZURE_EVENTS_API}"
        self.name_url = (f"{base}/metadata/instance/compute/name"
                         f"?api-version={AZURE_INSTANCE_API}&format=text")
        self.timeout_s = timeout_s
        self._wall_clock = wall_clock
        self._vm_name: str | None = None

    def check(self) -> Notice | None:
        resp = _http("GET", self.events_url, {"Metadata": "true"}, self.timeout_s)
        if resp.status != 200:
            raise _unexpected(resp, self.events_url)
        for event in _azure_events(resp.body, self.events_url):
            if event.get("EventType") in AZURE_PREEMPT_TYPES and self._is_ours(event):
                return self._notice(event)
        return None

    def _is_ours(self, event: Mapping) -> bool:
        resources = event.get("Resources")
        if not resources:
            return True
        if isinstance(resources, str):
            resources = [resources]
        return self.vm_name() in resources

    def vm_name(self) -> str:
        """This VM's name as scheduled events list it in ``Resources``."""
        if self._vm_name is None:
            resp = _http("GET", self.name_url, {"Metadata": "true"}, self.timeout_s)
            if resp.status != 200 or not resp.body.strip():
                raise _unexpected(resp, self.name_url)
            self._vm_name = resp.body.strip()
        return self._vm_name

    def _notice(self, event: Mapping) -> Notice:
        not_before = event.get("NotBefore")
        # Blank NotBefore: the event has already started.
        deadline = 0.0 if not_before == "" else _seconds_until(_parse_http_date(not_before),
                                                               self._wall_clock)
        reason = f"{str(event.get('EventType')).lower()}:{event.get('EventId', '?')}"
        return Notice(self.name, reason, deadline, json.dumps(event, sort_keys=True))


def _azure_events(body: str, url: str) -> list[Mapping]:
    try:
        doc = json.loads(body)
    except ValueError as err:
        raise MetadataError(f"GET {url}: not JSON: {body[:200]!r}") from err
    events = doc.get("Events") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise MetadataError(f"GET {url}: no Events list: {body[:200]!r}")
    return [e for e in events if isinstance(e, dict)]


def _parse_iso(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _parse_http_date(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _seconds_until(when: datetime | None, wall_clock: Callable[[], float]) -> float | None:
    # The only wall-clock arithmetic here: the services announce UTC times.
    if when is None:
        return None
    return max(0.0, when.timestamp() - wall_clock())


def build_providers(config: PreemptionConfig, *, clock: Callable[[], float] = time.monotonic,
                    wall_clock: Callable[[], float] = time.time) -> list[Provider]:
    """The providers ``config`` enables, in the order GCE, AWS, Azure."""
    providers: list[Provider] = []
    if config.gce:
        providers.append(GceProvider(config.base_url(GCE_METADATA_URL), timeout_s=config.timeout_s))
    if config.aws:
        providers.append(AwsProvider(config.base_url(AWS_METADATA_URL), timeout_s=config.timeout_s,
                                     clock=clock, wall_clock=wall_clock))
    if config.azure:
        providers.append(AzureProvider(config.base_url(AZURE_METADATA_URL),
                                       timeout_s=config.timeout_s, wall_clock=wall_clock))
    return providers


# -- the watcher --------------------------------------------------------------------------------

class PreemptionWatcher:
    """Poll every enabled provider; call ``on_notice`` once, with the first notice.

    ``on_notice`` runs on the thread that saw the notice (the watcher's thread
    after ``start()``, the caller's with ``poll_once()``): keep it short, e.g.
    set an event the daemon's main loop acts on. It may call ``stop()``. An
    exception it raises is logged, not propagated: the notice counts as delivered.
    Use either ``start()`` or ``poll_once()`` from one loop, not both: providers
    keep per-connection state (the AWS token) and are not meant to be shared.
    """

    def __init__(self, config: PreemptionConfig, on_notice: Callable[[Notice], None], *,
                 clock: Callable[[], float] = time.monotonic,
                 providers: Sequence[Provider] | None = None) -> None:
        self.config = config
        self._on_notice = on_notice
        self._clock = clock
        self.providers = list(providers) if providers is not None else build_providers(
            config, clock=clock)
        self._failing: dict[str, bool] = {p.name: False for p in self.providers}
        self._lock = threading.Lock()
        self._notice: Notice | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def notice(self) -> Notice | None:
        """The notice delivered to ``on_notice``, if any."""
        return self._notice

    def poll_once(self) -> Notice | None:
        """Poll each provider once; deliver and return the first notice.

        After a notice was delivered this returns it again without polling or
        calling ``on_notice``. Metadata errors are logged, never raised.
        """
        if self._notice is not None:
            return self._notice
        for provider in self.providers:
            notice = self._check(provider)
            if notice is not None:
                self._deliver(notice)
                return self._notice
        return None

    def start(self) -> PreemptionWatcher:
        """Poll in a daemon thread every ``poll_interval_s`` until a notice or ``stop()``."""
        if not self.providers:
            log.info("preemption watcher has no provider enabled; not polling")
            return self
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="elasticd-preemption",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop polling; waits for an in-flight poll (bounded by the HTTP timeouts)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            # Worst case per provider: AWS's token PUT + GET, renewed once on a 401.
            bound = self.config.poll_interval_s + self.config.timeout_s * 4 * len(self.providers)
            thread.join(bound if timeout_s is None else timeout_s)

    def _run(self) -> None:
        interval = self.config.poll_interval_s
        while not self._stop.is_set():
            started = self._clock()
            try:
                if self.poll_once() is not None:
                    return
            except Exception:  # a bug must not silently end preemption handling
                log.exception("preemption poll failed unexpectedly; still watching")
            # Fixed-rate polling: a slow poll does not push the next one back.
            self._stop.wait(max(0.0, interval - (self._clock() - started)))

    def _check(self, provider: Provider) -> Notice | None:
        try:
            notice = provider.check()
        except MetadataError as err:
            self._set_failing(provider.name, True, str(err))
            return None
        self._set_failing(provider.name, False)
        return notice

    def _set_failing(self, name: str, failing: bool, error: str = "") -> None:
        # Logged on change only: an outage polled every second must not flood the log.
        if self._failing.get(name) == failing:
            return
        self._failing[name] = failing
        if failing:
            log.warning("preemption metadata unavailable; still polling", provider=name, error=error)
        else:
            log.info("preemption metadata reachable again", provider=name)

    def _deliver(self, notice: Notice) -> None:
        with self._lock:
            # Two threads (start() and a main loop's poll_once) may see the notice at once.
            if self._notice is not None:
                return
            self._notice = notice
        self._stop.set()
        log.warning("preemption notice", provider=notice.provider, reason=notice.reason,
                    deadline_s=notice.deadline_s)
        try:
            self._on_notice(notice)
        except Exception:
            log.exception("preemption on_notice callback failed", provider=notice.provider)
