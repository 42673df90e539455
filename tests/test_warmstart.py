"""Warm worker starts (elasticd.warmstart): a real server forks real workers for real clients."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elasticd import proctree, warmstart

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

SCRIPT = """
import os, signal, sys, time
import torch
if sys.argv[1] == "wait-term":
    # os.write: a print in the handler could re-enter the print that is still flushing.
    signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b"got SIGTERM\\n"), sys.exit(75)))
print("worker", os.getpid(), torch.get_num_threads(), os.environ.get("MARK"), sys.argv[1:],
      os.getcwd(), flush=True)
if sys.argv[1] == "wait-term":
    time.sleep(60)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    sock = root / "warm.sock"
    # A thread count of the server's own, which no worker may inherit (test_..._bit_for_bit).
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "elasticd.warmstart", "--serve", str(sock),
                             "torch", "trainer.logs"], cwd=REPO, env=env)
    assert proctree.wait_for(sock.exists, 60), "the server never listened"
    (root / "w.py").write_text(SCRIPT)
    yield root, sock, proc
    proctree.kill_tree(proc.pid)
    proc.wait()


def _client(root: Path, sock: Path, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), MARK="m", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "elasticd.warmstart", str(sock),
                             str(root / "w.py"), *args], cwd=root, env=env, text=True,
                            stdout=subprocess.PIPE, start_new_session=True, **kw)


@pytest.mark.process
def test_a_warm_start_runs_the_script_with_the_clients_argv_env_cwd_and_exit_code(server):
    root, sock, _ = server
    client = _client(root, sock, "3")
    out, _ = client.communicate(timeout=30)
    assert client.returncode == 3
    pid, threads, mark, argv, cwd = out.split(" ", 5)[1:]
    assert (threads, mark, argv, cwd.strip()) == ("1", "m", "['3']", str(root))
    assert int(pid) != client.pid            # forked by the server, not exec'd by the client


def test_sigterm_to_the_client_reaches_the_worker(server):
    root, sock, _ = server
    client = _client(root, sock, "wait-term")
    assert client.stdout.readline().startswith("worker")
    client.send_signal(signal.SIGTERM)
    assert client.wait(30) == 75
    assert "got SIGTERM" in client.stdout.read()


def test_a_sigkilled_client_takes_its_worker_along(server):
    root, sock, proc = server
    client = _client(root, sock, "sleep")
    worker = int(client.stdout.readline().split()[1])
    client.kill()
    client.wait()
    gone = proctree.wait_for(lambda: not proctree.pid_alive(worker), 10)
    assert gone, "the worker outlived its client"
    assert psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE


@pytest.mark.process
def test_without_a_server_the_client_starts_the_script_cold(tmp_path):
    (tmp_path / "w.py").write_text(SCRIPT)
    client = _client(tmp_path, tmp_path / "absent.sock", "4")
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 4 and int(out.split()[1]) == client.pid


def test_a_worker_killed_by_a_signal_makes_its_client_die_of_it(server):
    root, sock, _ = server
    client = _client(root, sock, "sleep")
    worker = int(client.stdout.readline().split()[1])
    os.kill(worker, signal.SIGKILL)
    assert client.wait(30) == -signal.SIGKILL
    time.sleep(0.1)


def test_a_warm_worker_logs_its_own_rank(server):
    """trainer.logs was imported by the server (no RANK there): the line must carry ours."""
    root, sock, _ = server
    (root / "log.py").write_text(
        "from trainer.logs import configure_logging\nimport structlog\n"
        "configure_logging('info')\nstructlog.get_logger().info('hello')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="7")
    out = subprocess.run([sys.executable, "-m", "elasticd.warmstart", str(sock), str(root / "log.py")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"worker_rank": "7"' in out.stderr  # structlog writes to stderr


def test_an_uncaught_exception_goes_through_the_scripts_excepthook(server):
    """As in a cold interpreter: trainer.elastic's hook (failure commit, exit) must run."""
    root, sock, _ = server
    (root / "hook.py").write_text(
        "import os, sys\n"
        "def hook(kind, exc, tb):\n"
        "    sys.__excepthook__(kind, exc, tb)\n"
        "    os.write(1, b'hook saw ' + str(exc).encode() + b'\\n')\n"
        "    os._exit(9)\n"
        "sys.excepthook = hook\n"
        "raise RuntimeError('peer gone')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "elasticd.warmstart", str(sock), str(root / "hook.py")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (9, "hook saw peer gone\n"), out.stderr
    assert "RuntimeError: peer gone" in out.stderr  # the default hook's traceback, too


def test_a_warm_worker_ignores_sigpipe_as_a_cold_interpreter_does(server):
    """A write to a dead peer's socket must raise EPIPE, not kill the worker (exit -13)."""
    root, sock, _ = server
    (root / "pipe.py").write_text(
        "import signal, sys\nprint(signal.getsignal(signal.SIGPIPE) is signal.SIG_IGN)\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cold = subprocess.run([sys.executable, str(root / "pipe.py")], env=env, capture_output=True,
                          text=True, timeout=60)
    warm = subprocess.run([sys.executable, "-m", "elasticd.warmstart", str(sock), str(root / "pipe.py")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert cold.stdout == warm.stdout == "True\n", (cold.stdout, warm.stdout, warm.stderr)


@contextlib.contextmanager
def _cpu_hogs(count: int) -> Iterator[None]:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def _sigterm_during_a_start(server_pid: int, sock: Path, mode: str, delay: float | None
                            ) -> tuple[int | str, str]:
    """Start warm_signals.py MODE, SIGTERM its client ``delay`` s after the client's start
    (None: the moment the server has forked the worker); (exit status or "hang", stdout)."""
    server = psutil.Process(server_pid)
    before = {child.pid for child in server.children()}
    client = subprocess.Popen(
        [sys.executable, "-m", "elasticd.warmstart", str(sock), str(WORKERS / "warm_signals.py"), mode],
        env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    if delay is None:  # the race: a signal the client held, forwarded as the child starts
        deadline = time.monotonic() + 10
        while not {c.pid for c in server.children()} - before and time.monotonic() < deadline:
            pass
    else:
        time.sleep(delay)
    client.send_signal(signal.SIGTERM)
    try:
        status: int | str = client.wait(10)
    except subprocess.TimeoutExpired:
        status = "hang"
        client.kill()
        client.wait()
    return status, client.stdout.read()


def _as_a_cold_worker(mode: str, status: int | str, out: str) -> bool:
    """Killed by the SIGTERM (no handler yet), or its own handler ran (it had installed it)."""
    if mode == "handler" and "installed" in out:
        return status == 75 and "got SIGTERM" in out
    return status == -signal.SIGTERM


@pytest.mark.process
def test_a_sigterm_at_any_point_of_a_warm_start_ends_the_worker_as_a_cold_one(server):
    """Issue 29: a SIGTERM the client held until it had the pid found the forked child with
    the server's handler (exit 0, the script never ran) or was lost (the worker ran on)."""
    _, sock, proc = server
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    bad = []
    for hogs in (0, 2):  # idle, then under CPU load
        with _cpu_hogs(hogs):
            for i in range(12):
                mode = ("sleep", "spin", "handler")[i % 3]
                delay = None if i % 2 else rng.uniform(0.0, 1.0)
                status, out = _sigterm_during_a_start(proc.pid, sock, mode, delay)
                if not _as_a_cold_worker(mode, status, out):
                    bad.append((hogs, mode, delay, status, out))
    assert not bad, f"seed {seed}: {bad}"


@pytest.mark.parametrize("threads", [
    {"OMP_NUM_THREADS": "1"},                          # torchrun's, for nproc_per_node > 1
    {},                                                # torch's default
    {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"},  # MKL's wins
    {"OMP_NUM_THREADS": "3"},                          # MKL caps it at the physical cores
    {"OMP_NUM_THREADS": "3", "MKL_DYNAMIC": "false"},  # unless told not to
], ids=["omp1", "unset", "mkl-over-omp", "omp3", "omp3-static"])
@pytest.mark.slow
def test_a_warm_worker_computes_bit_for_bit_as_a_cold_one_with_its_environment(server, threads):
    """Same torch/OpenMP/MKL thread counts and the same float64 bits (issue 29: a warm
    worker kept the count torch took from the server's environment unless it set
    OMP_NUM_THREADS, and ignored MKL_NUM_THREADS)."""
    _, sock, _ = server
    env = {k: v for k, v in os.environ.items() if k not in (*THREAD_VARS, "MKL_DYNAMIC")}
    env.update(PYTHONPATH=str(REPO), **threads)
    script = str(WORKERS / "warm_threads.py")
    cold = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=120)
    warm = subprocess.run([sys.executable, "-m", "elasticd.warmstart", str(sock), script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert cold.returncode == warm.returncode == 0, (cold.stderr, warm.stderr)
    assert json.loads(warm.stdout) == json.loads(cold.stdout)


def test_the_server_logs_when_its_imports_are_done(tmp_path):
    # A newcomer's workers wait for the server's imports; its log says when they ended.
    proc = subprocess.Popen([sys.executable, "-m", "elasticd.warmstart", "--serve",
                             str(tmp_path / "warm.sock"), "json", "no.such.module"], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.PIPE,
                            text=True)
    try:
        failed, done = json.loads(proc.stderr.readline()), json.loads(proc.stderr.readline())
    finally:
        proc.kill()
        proc.wait()
    assert failed == {"event": "warm imports failed", "modules": ["no.such.module"]}
    assert done["event"] == "warm imports done" and done["s"] >= 0 and done["time"] > 0


MODULE = """
import atexit, os, sys, time
atexit.register(lambda: print("atexit ran", flush=True))
print("module", __name__, sys.argv[1:], os.getcwd(), sys.stdin.readline().strip(), flush=True)
print("title", open("/proc/self/cmdline", "rb").read().split(b"\\0")[0].decode(), flush=True)
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


def _spawn(root: Path, sock: Path, *args: str) -> tuple[warmstart.WarmChild, Path]:
    """``-m warm_mod ARGS`` forked by the server, its stdin a pipe, its output a file."""
    out = root / f"out-{random.randrange(1 << 30)}.txt"
    reader, writer = os.pipe()
    with open(out, "wb") as log:
        child = warmstart.spawn(sock, ["-m", "warm_mod", *args], dict(os.environ),
                                [reader, log.fileno(), log.fileno()], stdin=os.fdopen(writer, "wb"))
    os.close(reader)
    return child, out


def test_spawn_forks_a_module_with_its_argv_stdin_and_exit_code_and_runs_its_atexit(
        server, monkeypatch):
    # What the daemon does with its torchrun agent: ``-m MODULE``, credentials on stdin,
    # and the agent's atexit handlers (its rendezvous leave) must run as in a cold one.
    root, sock, _ = server
    (root / "warm_mod.py").write_text(MODULE)
    monkeypatch.chdir(root)
    child, out = _spawn(root, sock, "5")
    child.stdin.write(b"secret-line\n")
    child.stdin.close()
    assert child.wait(timeout=30) == 5 and child.poll() == 5
    assert out.read_text().splitlines() == [f"module __main__ ['5'] {root} secret-line",
                                            f"title {sys.executable} -m warm_mod 5", "atexit ran"]


def test_a_warm_child_is_polled_without_blocking_and_dies_with_its_connection(server, monkeypatch):
    root, sock, proc = server
    (root / "warm_mod.py").write_text(MODULE)
    monkeypatch.chdir(root)
    child, _ = _spawn(root, sock, "sleep")
    assert psutil.Process(child.pid).ppid() == proc.pid   # the server's child, not ours
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.1)
    child.close()   # as if the daemon died: the server SIGKILLs what it forked for it
    assert proctree.wait_for(lambda: not proctree.pid_alive(child.pid), 10)


def test_spawn_without_a_server_raises_for_the_cold_fallback(tmp_path):
    with pytest.raises(OSError):
        warmstart.spawn(tmp_path / "absent.sock", ["-m", "json"], {}, [0, 1, 2])


def test_the_host_says_importing_then_ready_then_dead(tmp_path):
    host = warmstart.WarmHost(sys.executable, tmp_path / "warm.sock", tmp_path / "warm.log")
    assert host.state() == "off"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{REPO}")
    (tmp_path / "time_slow.py").write_text("import time\ntime.sleep(1.5)\n")
    host.imports = ("time_slow",)   # stands in for torch's seconds of imports
    host.start(env)
    try:
        assert proctree.wait_for(lambda: host.state() == "importing", 10)
        assert proctree.wait_for(lambda: host.state() == "ready", 30)
    finally:
        host.proc.kill()
        host.proc.wait()
    assert host.state() == "dead"
    host.stop()
    assert not warmstart.ready_path(host.socket_path).exists()
