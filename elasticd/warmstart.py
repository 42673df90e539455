"""Warm worker starts: a per-node server that imported torch once forks every worker.

A cold worker pays ``import torch`` (1.0-1.6 s on this machine) and, at its first DDP
construction, ``import torch._dynamo`` (another 1.0-1.5 s) before its first step, on
every torchrun restart of every node. With warm starts the daemon runs one
``WarmServer`` per node for its whole life (its child: the no-orphan guarantee holds),
and torchrun runs, as each worker, the thin client::

    python -m elasticd.warmstart SOCKET SCRIPT ARGS...

which hands the server its argv, environment, working directory and standard streams,
then stands in for the forked worker: signals in, exit status out. A client that finds
no server starts the script cold (``python -u SCRIPT ARGS``), so a missing server slows
a start down and never fails it.

Nothing initialises CUDA before the fork (importing torch does not), so a forked worker
creates its CUDA context as a cold one would. The server stays single-threaded: fork
from a process with threads is not safe.

Protocol (a Unix stream socket, mode 0600, in the daemon's run dir): the client sends one
JSON line ``{"argv", "env", "cwd"}`` with its fds 0, 1 and 2 attached (SCM_RIGHTS); the
server forks and answers ``{"pid": N}``, later ``{"exit": CODE}`` (negative: killed by
that signal). When the client dies (SIGKILL) the server sees its connection close and
SIGKILLs the worker.

Signals: SIGTERM, SIGINT, SIGHUP and SIGUSR1/2 to the client reach the worker whenever
they come, with the disposition a cold worker would have then. One that comes before
the server has answered is held by the client and sent once it has the pid. The server
forks with them blocked; the child sets them to SIG_DFL (SIGINT too, where a cold
interpreter raises KeyboardInterrupt) before it unblocks them, so one already pending
is delivered then: it kills the worker, and the client dies of the same signal (exit
status 143 for SIGTERM), as a cold worker does. Once the script has installed a handler,
that handler runs.

Threads: a warm worker's torch (and MKL) intra-op thread count is the one a cold
interpreter with the worker's environment starts with (``cold_threads``): the server
imports torch without OMP_NUM_THREADS/MKL_NUM_THREADS, and each child sets its own count.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import re
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticd.contract.identity import WORKER_USER_VAR, WorkerIdentity, become_worker, exec_worker

# What a trainer worker imports before its first step (the expensive part of a start).
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo",
                   "numpy", "structlog", "trainer.loop", "trainer.examples.common",
                   "checkpointing")
# What the torchrun agent imports beyond them (0.2 s more): the daemon forks its agent
# here too (``spawn``; elasticd.agent), which saves the agent its own ``import torch``.
AGENT_IMPORTS = ("torch.distributed.run", "elasticd.rendezvous.handler")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
SPAWN_TIMEOUT_S = 5.0   # a ready server forks in milliseconds
_THREAD_VARS = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")  # torch's precedence
_MAX_REQUEST = 1 << 20


def preload(modules: Sequence[str]) -> list[str]:
    """Import ``modules``; returns the ones that failed (a warm start then imports them cold)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a missing optional module only costs warmth
            failed.append(name)
    return failed


class WarmServer:
    """Accepts start requests on ``path`` and forks a worker for each (see module doc)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.listener.bind(path)
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.workers: dict[int, socket.socket] = {}   # worker pid -> its client's connection
        self.default_threads: int | None = None  # torch's, for workers that set none (serve)

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=0.05):
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._client_gone(key.data)
            self._reap()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            request, fds = _receive(conn)
            pid, mask = _fork_with_forwarded_blocked()
        except (OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                _send(conn, {"error": str(exc)})
            conn.close()
            return
        if pid == 0:
            self._become_worker(request, fds, mask)  # never returns
        for fd in fds:
            os.close(fd)
        self.workers[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        try:
            _send(conn, {"pid": pid})
        except OSError:
            self._client_gone(pid)

    def _client_gone(self, pid: int) -> None:
        """The client's connection closed or spoke: it died; its worker must not outlive it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.workers:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.workers.pop(pid, None)
            if conn is None:
                continue
            self.selector.unregister(conn)
            with contextlib.suppress(OSError):
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()

    def _become_worker(self, request: dict[str, Any], fds: list[int],
                       mask: set[signal.Signals]) -> None:
        code = 1
        try:
            _worker_signals(mask)  # first: a signal already pending is delivered here
            self.selector.close()
            self.listener.close()
            for conn in self.workers.values():
                conn.close()
            code = run_worker(request, fds, self.default_threads)
        except BaseException:  # noqa: BLE001 - the worker's exit code says it
            # What the interpreter does with an uncaught exception: the script's own
            # sys.excepthook (trainer.elastic's commits and exits), else the traceback.
            with contextlib.suppress(BaseException):
                sys.excepthook(*sys.exc_info())
        finally:
            _exit_as_an_interpreter_does()
            os._exit(code)


def _exit_as_an_interpreter_does() -> None:
    """What a cold interpreter does before it exits: wait for the non-daemon threads, run
    the ``atexit`` handlers (the script's, and those of the modules it imported, which
    the server imported for it), flush. Without it a warm worker ended as if by
    ``os._exit``: a script's handlers (a metrics logger's flush, the rendezvous leave of
    a torchrun agent started warm) never ran."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined] - what Py_Finalize calls
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()


def _fork_with_forwarded_blocked() -> tuple[int, set[signal.Signals]]:
    """``os.fork()`` with FORWARDED blocked; returns (pid, the mask before).

    The parent gets its mask back at once. The child keeps them blocked until
    ``_worker_signals`` has given it the worker's dispositions: a signal sent to it before
    then (the client forwards one it held as soon as it has the pid) stays pending in the
    kernel, where neither the server's SIGTERM handler (exit 0) nor CPython's after-fork
    reset of its pending-signal flags (the signal lost) can get at it.
    """
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return pid, mask


def _worker_signals(mask: set[signal.Signals]) -> None:
    """In the child, FORWARDED still blocked: a cold interpreter's dispositions, then unblock.

    SIG_DFL for FORWARDED and SIGCHLD and for any other signal the server gave a Python
    handler, so a pending signal is delivered with the disposition the worker would have
    (SIGTERM kills it, exit -15) and a script's own handlers apply from when it installs
    them. SIGINT is SIG_DFL too, not the KeyboardInterrupt of a cold interpreter.
    """
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if sig in (*FORWARDED, signal.SIGCHLD) or (
                callable(handler) and handler is not signal.default_int_handler):
            signal.signal(sig, signal.SIG_DFL)
    # What a cold interpreter does at start-up: a write to a closed socket raises EPIPE
    # instead of killing the process. With SIG_DFL here, a worker whose gloo peer had just
    # been SIGKILLed died of SIGPIPE (exit -13) and the in-place re-form lost its rank 0.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask - set(FORWARDED))


def run_worker(request: dict[str, Any], fds: list[int], default_threads: int | None = None) -> int:
    """In the forked child: become the worker the client asked for and run its script.

    ``default_threads``: torch's intra-op thread count for an environment that sets none
    (``_thread_settings``); None leaves the server's.
    """
    os.setsid()  # its own session, as torchrun starts workers
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    _parent_death_kills_me()
    os.environ.clear()
    os.environ.update(request["env"])
    if request.get("user"):   # [job] worker_user: the script runs as that user, uncapable
        become_worker(WorkerIdentity.decode(request["user"]), os.environ)
    os.chdir(request["cwd"])
    _thread_settings(default_threads)
    argv = list(request["argv"])
    module = argv[1] if argv[0] == "-m" and len(argv) > 1 else None
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process' own stdin
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    try:
        if module is not None:   # ``-m MODULE ARGS``: what ``python -m`` does (the agent)
            _title([sys.executable, *argv])
            sys.argv = [module, *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def _title(command: list[str]) -> None:
    """Show ``command`` as this process's command line (``ps``, ``/proc/PID/cmdline``): a
    forked child keeps the server's otherwise, and the torchrun agent is found by its own
    (by operators, the chaos lab, the benchmarks). Workers keep the server's, which is how
    the tools tell them from their clients."""
    setproctitle = sys.modules.get("setproctitle")   # imported by ``serve``
    if setproctitle is not None:   # a declared dependency; without it only ``ps`` is less clear
        setproctitle.setproctitle(" ".join(command))


def cold_threads(env: Mapping[str, str], default: int, mkl: bool) -> int:
    """The intra-op thread count torch starts with in a cold interpreter given ``env``;
    ``default``: its count when no thread variable is set (physical cores).

    As measured with torch 2.13: MKL_NUM_THREADS, else OMP_NUM_THREADS (the leading
    integer, if positive), else ``default``; with MKL, torch takes MKL's count, which MKL
    caps at ``default`` unless MKL_DYNAMIC=false (OMP_NUM_THREADS=3 on 2 cores: 2 threads).
    """
    requested = [int(m.group()) for m in (re.match(r"\s*\+?\d+", env.get(var, ""))
                                          for var in _THREAD_VARS) if m and int(m.group()) > 0]
    if not requested:
        return default
    if mkl and env.get("MKL_DYNAMIC", "").lower() != "false":
        return min(requested[0], default)
    return requested[0]


def _thread_settings(default: int | None) -> None:
    """Give torch (and MKL) the thread count a cold worker with this environment gets.

    torch took its count from the server's environment (measured: with OMP_NUM_THREADS=1
    there, a worker that set none ran 1 thread warm and 2 cold; one with MKL_NUM_THREADS=1
    ran 2 warm and 1 cold; a float64 sum and MLP gradients then differ in their last bits).
    """
    torch = sys.modules.get("torch")
    if torch is not None and default is not None:
        torch.set_num_threads(cold_threads(os.environ, default, torch.backends.mkl.is_available()))


def _parent_death_kills_me() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PDEATHSIG


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    conn.settimeout(5.0)
    data, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(_MAX_REQUEST)
        if not more:
            raise ValueError("the client hung up mid-request")
        data += more
    conn.settimeout(None)
    request = json.loads(data)
    if not (isinstance(request, dict) and isinstance(request.get("argv"), list)
            and request["argv"] and isinstance(request.get("env"), dict)
            and isinstance(request.get("cwd"), str) and len(fds) == 3):
        for fd in fds:
            os.close(fd)
        raise ValueError("malformed start request")
    return request, fds


# -- the client (what torchrun runs as a worker) -------------------------------------------

def client(socket_path: str, argv: list[str]) -> None:
    """Start ``argv`` (SCRIPT ARGS...) through the server; mirror it; never returns."""
    # Handlers first: a signal that comes before the worker exists is held for it.
    worker: list[int] = []
    held: list[int] = []
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _f: _forward(worker[0], s) if worker else held.append(s))
    try:
        _conn, reader, pid = _request(socket_path, argv, dict(os.environ), os.getcwd(), [0, 1, 2],
                                      user=os.environ.get(WORKER_USER_VAR))
        worker.append(pid)
    except (OSError, ValueError, KeyError, TypeError):
        if held:
            _exit_like(-held[0])
        _cold(argv)
    for sig in held:
        _forward(worker[0], sig)
    line = reader.readline()  # PEP 475: retried after each forwarded signal
    _exit_like(json.loads(line).get("exit", 1) if line else 1)


def _request(socket_path: str, argv: list[str], env: Mapping[str, str], cwd: str,
             fds: list[int], timeout: float | None = None,
             user: str | None = None) -> tuple[socket.socket, Any, int]:
    """Ask the server to fork ``argv`` with ``fds`` as its 0, 1 and 2: the connection
    (the child lives while it is open), its reader (the exit line comes there) and the
    pid. ``timeout`` bounds the wait for the pid (None: as long as the server's imports).
    ``user``: the identity the child takes before it runs ``argv`` (a worker's; the
    agent, which holds the etcd credentials, keeps the server's)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(socket_path)
        request = {"argv": argv, "env": dict(env), "cwd": cwd, "user": user}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        reader = conn.makefile("rb")
        pid = int(json.loads(reader.readline() or b"{}")["pid"])
        conn.settimeout(None)
        return conn, reader, pid
    except BaseException:
        conn.close()
        raise


class WarmChild:
    """A process the server forked for this one (``spawn``), with what the daemon uses of
    ``subprocess.Popen``: ``pid``, ``stdin``, ``poll``, ``wait``, ``returncode``. Its exit
    status comes over the connection (negative: killed by that signal); the connection's
    end without one is the server's death, which kills the child (its parent-death
    signal). Closing the connection (``close``, or this process's death) SIGKILLs it."""

    def __init__(self, conn: socket.socket, reader: Any, pid: int, stdin: Any = None) -> None:
        self._conn, self._reader = conn, reader
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            readable, _, _ = select.select([self._conn], [], [], 0)
            if readable:
                self._read_exit()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            readable, _, _ = select.select([self._conn], [], [], timeout)
            if not readable:
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
            self._read_exit()
        assert self.returncode is not None
        return self.returncode

    def _read_exit(self) -> None:
        line = self._reader.readline()
        try:
            self.returncode = int(json.loads(line)["exit"]) if line else -signal.SIGKILL
        except (ValueError, KeyError, TypeError):
            self.returncode = 1
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._reader.close()
            self._conn.close()


def spawn(socket_path: str | Path, argv: list[str], env: Mapping[str, str], fds: list[int],
          stdin: Any = None, timeout: float = SPAWN_TIMEOUT_S) -> WarmChild:
    """Fork ``argv`` (``SCRIPT ARGS`` or ``-m MODULE ARGS``) from the ready server at
    ``socket_path``, with ``fds`` (the parent's, still owned by it) as its 0, 1 and 2 and
    this process's working directory. ``stdin``: the writer of a pipe whose reader is
    ``fds[0]``, kept as the child's ``stdin``. Raises OSError or ValueError when no
    server answers within ``timeout`` (the caller then starts it cold; a fork that comes
    later finds the connection closed and is SIGKILLed)."""
    try:
        conn, reader, pid = _request(str(socket_path), argv, env, os.getcwd(), fds, timeout)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"the warm-start server did not answer with a pid: {exc!r}") from None
    return WarmChild(conn, reader, pid, stdin)


def ready_path(socket_path: str | Path) -> Path:
    """The file the server creates once its imports are done (removed when it starts)."""
    return Path(f"{socket_path}.ready")


def _forward(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _exit_like(code: int) -> None:
    sys.stdout.flush()
    if code < 0:  # the worker died of a signal: so does its stand-in (torchrun reads that)
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    os._exit(code if code >= 0 else 1)


def _cold(argv: list[str]) -> None:
    exec_worker([sys.executable, "-u", *argv])   # as the worker user, if there is one


class WarmHost:
    """The daemon's handle on its node's server: one process for the daemon's life.

    Started with the workers' environment (so imports see what workers see) and a
    parent-death signal; a dead server only makes the next starts cold (the client's
    fallback), so nothing restarts it.
    """

    def __init__(self, python: str, socket_path: Path, log_path: Path,
                 imports: Sequence[str] = ()) -> None:
        self.python = python
        self.socket_path = socket_path
        self.log_path = log_path
        self.imports = (*DEFAULT_IMPORTS, *AGENT_IMPORTS, *imports)
        self.proc: subprocess.Popen | None = None
        self.started_at: float | None = None   # time.monotonic() of the start
        self._ready = False   # the server said its imports are done (it stays so)

    def state(self) -> str:
        """``off`` (never started), ``importing``, ``ready`` (forks at once) or ``dead``."""
        if self.proc is None:
            return "off"
        if self.proc.poll() is not None:
            return "dead"
        # Asked every cycle: the file is looked at until it is there, then no more.
        self._ready = self._ready or ready_path(self.socket_path).exists()
        return "ready" if self._ready else "importing"

    def start(self, env: Mapping[str, str]) -> None:
        from elasticd import proctree

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        command = proctree.with_parent_death_signal(
            [self.python, "-m", "elasticd.warmstart", "--serve", str(self.socket_path),
             *self.imports])
        ready_path(self.socket_path).unlink(missing_ok=True)   # a previous server's
        self._ready = False
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(command, env=dict(env), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.started_at = time.monotonic()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        ready_path(self.socket_path).unlink(missing_ok=True)


def serve(socket_path: str, imports: Sequence[str] = DEFAULT_IMPORTS) -> None:
    """The server's main: import, then serve until killed."""
    # Before the environment changes: setproctitle finds the command line's memory by the
    # environment's (on its first call, not at import), and a forked child that cleared
    # its environment first set no title.
    with contextlib.suppress(ImportError):
        import setproctitle
        setproctitle.getproctitle()   # initialised here, used by _title in the children
    # Listen first: a client that comes during the imports waits in the backlog for them
    # (about what a cold start would take) instead of starting cold beside them.
    server = WarmServer(socket_path)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # Without these torch takes its default thread count, the one a cold worker whose
    # environment sets neither gets; every worker then sets the count of its own (run_worker).
    for var in _THREAD_VARS:
        os.environ.pop(var, None)
    ready = ready_path(socket_path)
    ready.unlink(missing_ok=True)
    started = time.monotonic()
    failed = preload(imports)
    if failed:
        print(json.dumps({"event": "warm imports failed", "modules": failed}), file=sys.stderr)
    # When warm starts begin (a newcomer's workers wait for this): the log says it, and
    # the ready file tells the daemon it may fork its agent here (WarmHost.state).
    print(json.dumps({"event": "warm imports done", "s": round(time.monotonic() - started, 3),
                      "time": time.time()}), file=sys.stderr, flush=True)
    ready.touch()
    torch = sys.modules.get("torch")
    server.default_threads = torch.get_num_threads() if torch is not None else None
    server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) >= 2 and args[0] == "--serve":
        serve(args[1], args[2:] or DEFAULT_IMPORTS)
    elif len(args) >= 2:
        client(args[0], args[1:])
    else:
        sys.exit("usage: python -m elasticd.warmstart SOCKET SCRIPT [ARGS...]\n"
                 "       python -m elasticd.warmstart --serve SOCKET [MODULE ...]")


if __name__ == "__main__":
    main()
