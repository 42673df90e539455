"""A fake cloud metadata service (GCE, AWS IMDSv2, Azure IMDS) on 127.0.0.1.

It enforces what the real services enforce, so a client that gets a header or
the AWS token flow wrong fails against it the way it would in the cloud:

* GCE: ``Metadata-Flavor: Google`` is required (403 without it); requests with
  ``X-Forwarded-For`` are refused (403).
* AWS: a token from ``PUT /latest/api/token`` (with
  ``X-aws-ec2-metadata-token-ttl-seconds`` in 1..21600, else 400; a GET there
  is 405) is required on every GET (401 without it, or with an unknown or
  expired or revoked token); ``spot/instance-action`` is 404 until announced.
* Azure: ``Metadata: true`` is required (400 without it), and ``api-version``.

Every request is recorded in ``requests`` as ``(method, path, status)``.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from datetime import UTC, datetime
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

AWS_MAX_TTL_S = 21600
REJECTED = frozenset({400, 401, 403, 405})


class Seen(NamedTuple):
    method: str
    path: str
    status: int


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that timed out and hung up is expected in tests, not an error.
        pass


class FakeMetadata:
    """Start with ``start()`` (or ``with``); ``url`` is the base URL to configure."""

    def __init__(self, azure_vm_name: str = "trainer-vm-1") -> None:
        self.azure_vm_name = azure_vm_name
        self.gce_preempted = False
        self.aws_action: dict | str | None = None
        self.azure_events: list[dict] = []
        self.azure_incarnation = 1
        self.fail_status: int | None = None  # answer everything with this status
        self.hang_s = 0.0  # delay every answer (a slow or wedged service)
        self.requests: list[Seen] = []
        self._tokens: dict[str, float] = {}
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        self._thread: threading.Thread | None = None

    # -- lifecycle

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeMetadata:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-metadata", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeMetadata:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the service announces

    def announce_gce(self) -> None:
        self.gce_preempted = True

    def announce_aws(self, action: str = "terminate", at: float | None = None) -> None:
        """A spot interruption ``at`` (epoch seconds; default two minutes from now)."""
        when = datetime.fromtimestamp(time.time() + 120 if at is None else at, UTC)
        self.aws_action = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}

    def announce_azure(self, event_type: str = "Preempt", resources: list[str] | None = None,
                       not_before: float | str | None = None) -> dict:
        """Add a scheduled event (default: Preempt of this VM 30 s from now); return it."""
        if not_before is None or isinstance(not_before, float | int):
            at = time.time() + 30 if not_before is None else not_before
            not_before = format_datetime(datetime.fromtimestamp(int(at), UTC), usegmt=True)
        event = {"EventId": str(uuid.uuid4()), "EventStatus": "Scheduled", "EventType": event_type,
                 "ResourceType": "VirtualMachine",
                 "Resources": [self.azure_vm_name] if resources is None else resources,
                 "NotBefore": not_before, "Description": "", "EventSource": "Platform",
                 "DurationInSeconds": -1}
        with self._lock:
            self.azure_events.append(event)
            self.azure_incarnation += 1
        return event

    def revoke_aws_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    # -- what the tests inspect

    def seen(self, path_prefix: str = "") -> list[Seen]:
        with self._lock:
            return [r for r in self.requests if r.path.startswith(path_prefix)]

    @property
    def rejections(self) -> list[Seen]:
        return [r for r in self.seen() if r.status in REJECTED]

    @property
    def token_puts(self) -> int:
        return sum(1 for r in self.seen("/latest/api/token") if r.method == "PUT" and r.status == 200)

    # -- request handling

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        if self.hang_s:
            self._release.wait(self.hang_s)
        split = urlsplit(req.path)
        query = {k: v[0] for k, v in parse_qs(split.query).items()}
        if self.fail_status is not None:
            status, body, headers = self.fail_status, "injected failure", {}
        elif split.path.startswith("/computeMetadata/"):
            status, body, headers = self._gce(req, split.path)
        elif split.path.startswith("/latest/"):
            status, body, headers = self._aws(req, split.path)
        elif split.path.startswith("/metadata/"):
            status, body, headers = self._azure(req, split.path, query)
        else:
            status, body, headers = 404, "not found", {}
        with self._lock:
            self.requests.append(Seen(req.command, req.path, status))
        _answer(req, status, body, headers)

    def _gce(self, req, path: str) -> tuple[int, str, dict]:
        if req.headers.get("X-Forwarded-For") or req.headers.get("Metadata-Flavor") != "Google":
            return 403, "Missing Metadata-Flavor:Google header.", {}
        if req.command != "GET":
            return 405, "method not allowed", {}
        if path != "/computeMetadata/v1/instance/preempted":
            return 404, "not found", {}
        return 200, "TRUE" if self.gce_preempted else "FALSE", {"Metadata-Flavor": "Google"}

    def _aws(self, req, path: str) -> tuple[int, str, dict]:
        if path == "/latest/api/token":
            return self._aws_token(req)
        if req.command != "GET":
            return 405, "", {}
        token = req.headers.get("X-aws-ec2-metadata-token")
        with self._lock:
            expires = self._tokens.get(token or "")
        if expires is None or time.monotonic() >= expires:
            return 401, "", {}
        if path != "/latest/meta-data/spot/instance-action" or self.aws_action is None:
            return 404, "Not Found", {}
        action = self.aws_action
        return 200, action if isinstance(action, str) else json.dumps(action), {}

    def _aws_token(self, req) -> tuple[int, str, dict]:
        if req.command != "PUT":
            return 405, "", {}
        if req.headers.get("X-Forwarded-For"):
            return 403, "", {}
        try:
            ttl = int(req.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
        except ValueError:
            return 400, "", {}
        if not 1 <= ttl <= AWS_MAX_TTL_S:
            return 400, "", {}
        token = secrets.token_urlsafe(24)
        with self._lock:
            self._tokens[token] = time.monotonic() + ttl
        return 200, token, {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)}

    def _azure(self, req, path: str, query: dict) -> tuple[int, str, dict]:
        if (req.headers.get("Metadata", "").lower() != "true" or req.headers.get("X-Forwarded-For")
                or "api-version" not in query):
            return 400, json.dumps({"error": "Bad request. Required metadata header not specified"}), {}
        if req.command != "GET":
            return 405, "", {}
        if path == "/metadata/scheduledevents":
            with self._lock:
                doc = {"DocumentIncarnation": self.azure_incarnation, "Events": list(self.azure_events)}
            return 200, json.dumps(doc), {"Content-Type": "application/json"}
        if path == "/metadata/instance/compute/name" and query.get("format") == "text":
            return 200, self.azure_vm_name, {"Content-Type": "text/plain"}
        return 404, "not found", {}


def _handler_for(fake: FakeMetadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fake.handle(self)

        def do_PUT(self) -> None:
            self._drain_body()
            fake.handle(self)

        def do_POST(self) -> None:
            self._drain_body()
            fake.handle(self)

        def _drain_body(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def _answer(req: BaseHTTPRequestHandler, status: int, body: str, headers: dict) -> None:
    data = body.encode()
    req.send_response(status)
    for key, value in headers.items():
        req.send_header(key, value)
    req.send_header("Content-Length", str(len(data)))
    req.end_headers()
    req.wfile.write(data)
