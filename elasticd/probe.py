"""Application-level liveness: each daemon answers a TCP probe with one byte.

A kernel accepts TCP connections for a stopped (SIGSTOP) process, so a bare
connect proves nothing; the daemon's own thread must reply. Outcomes:

* ``ALIVE``: the daemon answered;
* ``REFUSED``: nothing listens (the daemon died): certain, and immediate;
* ``SILENT``: connected or timed out without an answer (stopped, hung, partitioned).

Each daemon probes only its ``neighbours`` successors in node-id order (a ring), so a
daemon's probes per second stay the same whatever the number of nodes, and every node
is still watched by that many predecessors, and every peer that some record suspects
(``elasticd.quorum``) is probed by every daemon, so each live member has its own
answer to vote with. A failed probe is only a suspicion: who is dead is decided by a
majority of the members (``quorum.condemned``), or by etcd when a peer's lease expires.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

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


def ring_successors(me: str, peers: Iterable[str], k: int) -> list[str]:
    """The ``k`` peers after ``me`` in node-id order, wrapping around (``me`` need not be
    among ``peers``); every peer when ``k`` is 0 or covers them all."""
    ids = sorted(set(peers) - {me})
    if k <= 0 or k >= len(ids):
        return ids
    after = [i for i in ids if i > me]
    return (after + [i for i in ids if i < me])[:k]


class Prober:
    """Probes its peers each ``interval_s`` from a thread; collects those refused.

    With ``me`` and ``neighbours`` > 0 only the ring successors (``ring_successors``) are
    probed; else every peer.

    Every answer is reported (``take_answers``): the daemon turns a refusal into a
    suspicion at once and a silence into one after a while (slowness is not death). Probes run
    concurrently, so a few silent peers never delay the others by their timeouts.
    ``confirm`` probes one vanished peer off the caller's thread; its answer is
    collected with ``take_confirmations``.
    """

    def __init__(self, peers: Callable[[], Mapping[str, Any]], interval_s: float,
                 timeout_s: float = 0.3, confirm_timeout_s: float = 0.5,
                 me: str = "", neighbours: int = 0) -> None:
        self._peers = peers       # () -> {node_id: membership.Peer}
        self._me, self._neighbours = me, neighbours
        self._answers: dict[str, str] = {}
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._confirm_timeout_s = confirm_timeout_s
        self._refused: dict[str, Any] = {}
        self._confirmed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="elasticd-probe")
        self._thread = threading.Thread(target=self._run, name="elasticd-prober", daemon=True)

    def start(self) -> Prober:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            peers = self.targets()
            try:
                answers = list(self._pool.map(lambda p: probe(p.probe, self._timeout_s), peers))
            except RuntimeError:
                return  # the pool was shut down: we are stopping
            with self._lock:
                for peer, liveness in zip(peers, answers, strict=True):
                    self._answers[peer.node_id] = liveness.value
                    if liveness is Liveness.REFUSED:
                        self._refused[peer.node_id] = peer

    def targets(self) -> list[Any]:
        """The peers this round probes: the ring successors among those with a probe, and
        every peer some record suspects (so that every member votes on it)."""
        peers = self._peers()
        probed = {p.node_id: p for p in peers.values() if p.probe}
        chosen = ring_successors(self._me, probed, self._neighbours)
        suspected = {n for p in peers.values() for n in getattr(p, "suspects", ())}
        chosen += sorted(n for n in suspected & set(probed) if n not in chosen and n != self._me)
        return [probed[i] for i in chosen]

    def take_answers(self) -> dict[str, str]:
        """The latest answer of each peer probed since the last call (alive|refused|silent)."""
        with self._lock:
            answers, self._answers = self._answers, {}
        return answers

    def confirm(self, node_id: str, endpoint: str | None) -> None:
        """Probe a peer once more in the background (no endpoint: it counts as refused)."""
        if endpoint is None:
            with self._lock:
                self._confirmed[node_id] = Liveness.REFUSED.value
            return

        def run() -> None:
            answer = probe(endpoint, self._confirm_timeout_s)
            with self._lock:
                self._confirmed[node_id] = answer.value
        with contextlib.suppress(RuntimeError):
            self._pool.submit(run)

    def take_refused(self) -> list[Any]:
        with self._lock:
            refused, self._refused = list(self._refused.values()), {}
        return refused

    def take_confirmations(self) -> dict[str, str]:
        with self._lock:
            confirmed, self._confirmed = self._confirmed, {}
        return confirmed

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._pool.shutdown(wait=False, cancel_futures=True)
