"""Application-level liveness: each daemon answers a TCP probe with one byte.

A kernel accepts TCP connections for a stopped (SIGSTOP) process, so a bare
connect proves nothing; the daemon's own thread must reply. Outcomes:

* ``ALIVE``: the daemon answered;
* ``REFUSED``: nothing listens (the daemon died): certain, and immediate;
* ``SILENT``: connected or timed out without an answer (stopped, hung, partitioned).
"""

from __future__ import annotations

import contextlib
import enum
import socket
import threading

import structlog

log = structlog.get_logger(__name__)

_REPLY = b"E"


class Liveness(enum.Enum):
    ALIVE = "alive"
    REFUSED = "refused"
    SILENT = "silent"


class ProbeServer:
    """Answers every connection with one byte, from a daemon thread."""

    def __init__(self, addr: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.create_server((addr, port), reuse_port=False)
        self._sock.settimeout(0.5)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="elasticd-probe", daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.sendall(_REPLY)

    def stop(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2)


def probe(endpoint: str, timeout_s: float = 1.0) -> Liveness:
    """One probe of a peer daemon's ``host:port``."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return Liveness.ALIVE if sock.recv(1) == _REPLY else Liveness.SILENT
    except ConnectionRefusedError:
        return Liveness.REFUSED
    except OSError:
        return Liveness.SILENT


class Prober:
    """Probes every peer each ``interval_s`` from a thread; collects those refused.

    Only REFUSED is acted on (a crashed daemon, certain and immediate); a SILENT
    peer is left to its lease, because slowness is not death.
    """

    def __init__(self, peers, interval_s: float, timeout_s: float = 0.3) -> None:
        self._peers = peers       # () -> dict[node_id, Peer]
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._refused: dict[str, object] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elasticd-prober", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            for node_id, peer in self._peers().items():
                endpoint = peer.record.get("probe")
                if endpoint and probe(endpoint, self._timeout_s) is Liveness.REFUSED:
                    with self._lock:
                        self._refused[node_id] = peer

    def take_refused(self) -> list:
        with self._lock:
            refused, self._refused = list(self._refused.values()), {}
        return refused

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
