"""deploy/README.md's path from three VMs to a running job, each step as far as one machine
and loopback allow.

- Step 1: the wheel builds from pyproject.toml with ``pip wheel --no-deps
  --no-build-isolation --no-index`` (offline: the venv's setuptools builds it; no ``wheel``
  package is needed) from a copy of the sources, so the checkout gets no build/ or
  egg-info.
- Step 5: it installs into a fresh venv (``--no-deps``: its dependencies come from this
  interpreter's site-packages through a .pth line, since nothing is downloaded here), and
  the installed ``elasticd`` entry point runs ``--version``, ``elasticd doctor`` against a
  real etcd, and the daemon itself in a working directory like the unit's, with a relative
  entrypoint, until READY=1 and a training step (then a drain).
- Steps 4 and 6: every option the README names exists in elasticd/config.py, with the
  default it gives; the ports table's shipped values are what every shipped cluster config
  sets, and every port option of the config is in the table; every shipped config (cloud-
  init's copies too) loads with load_config and a node's env file; every ELASTICD_*
  variable it names is an override; every ``elasticd`` command and option it shows exists.
- Steps 5 and 7: the unit's WorkingDirectory (absolute, read-only to the job, made by the
  README and cloud-init), its ExecStart (the venv's ``elasticd`` console script, ``run
  --config``), and Type=notify because the daemon notifies.

systemd as PID 1, more machines, firewalls and NFS are not here; the 3-member etcd cluster
from deploy/etcd is test_etcd_cluster.py's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import click
import pytest

from elasticd import cli, proctree
from elasticd.config import _SECTIONS, ENV_OVERRIDES, load_config
from tests.deploy.conftest import DEPLOY, REPO, NotifySocket, node_copy, read_env_file
from tests.deploy.test_configs import CLUSTER, ENV_EXAMPLE, SHIPPED
from tests.deploy.test_units import UNITS, one, parse_unit, writable_paths

README = DEPLOY / "README.md"
VENV = "/opt/elasticd/venv"
TRAIN_DIR = "/opt/elasticd/train"
# What the wheel is built from (pyproject.toml's packages, and its readme).
SOURCES = ("pyproject.toml", "README.md", "elasticd", "trainer", "checkpointing")


def readme() -> str:
    return README.read_text()


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n#", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def field_of(section_name: str, key: str) -> dataclasses.Field | None:
    cls = _SECTIONS.get(section_name)
    if cls is None:
        return None
    return next((f for f in dataclasses.fields(cls) if f.name == key), None)


def toml_value(literal: str):
    return tomllib.loads(f"v = {literal}")["v"]


def plain(value):
    return list(value) if isinstance(value, tuple) else value


# -- steps 4 and 6: what the README names ------------------------------------------------------

NAMED_OPTION = re.compile(r"`\[(\w+)\] (\w+)")             # `[recovery] store_port ...`
DOTTED_OPTION = re.compile(r"`(\w+)\.(\w+)`")              # `checkpoint.dir`
STATED_DEFAULT = re.compile(r"`\[(\w+)\] (\w+)` = `([^`]+)`")


def test_every_option_the_readme_names_exists():
    text = readme()
    named = set(NAMED_OPTION.findall(text))
    named |= {(s, k) for s, k in DOTTED_OPTION.findall(text) if s in _SECTIONS}
    assert len(named) >= 15, sorted(named)
    missing = sorted(f"[{s}] {k}" for s, k in named if field_of(s, k) is None)
    assert not missing, f"deploy/README.md names options elasticd/config.py lacks: {missing}"


def test_every_default_the_readme_states_is_the_code_s():
    stated = STATED_DEFAULT.findall(readme())
    assert {(s, k) for s, k, _ in stated} >= {("recovery", "store_port"), ("metrics", "port"),
                                              ("metrics", "addr"), ("node", "addr"),
                                              ("etcd", "endpoints")}
    for s, k, literal in stated:
        f = field_of(s, k)
        assert f is not None and f.default is not dataclasses.MISSING, (s, k)
        assert toml_value(literal) == plain(f.default), f"[{s}] {k}: README {literal}, code {f.default!r}"


def ports_table() -> list[list[str]]:
    rows = [line for line in section(readme(), "### 4. Ports to open").splitlines()
            if line.startswith("| ")]   # not the |---| line
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells[0][:3] == ["Port", "What listens, where", "Option = default"], cells[0]
    assert all(len(row) == len(cells[0]) for row in cells), cells
    return cells[1:]


def cluster_configs() -> list[tuple[str, dict]]:
    """The shipped configs a cluster node gets: the two examples and cloud-init's copies."""
    out = [(name, raw) for name, raw in SHIPPED if name.split(":")[-1].rsplit("/", 1)[-1] in CLUSTER]
    assert len(out) >= 4, [name for name, _ in out]
    return out


def test_the_ports_table_matches_the_configs_and_the_scripts():
    rows = ports_table()
    by_option = {}
    for port, _what, option, shipped, _to in rows:
        if option == "—":
            continue
        match = STATED_DEFAULT.search(option)
        assert match, f"port {port}: write the option as `[section] key` = `default`, or —"
        s, k, _ = match.groups()
        by_option[(s, k)] = (port, shipped)
    # Every port option of the config is in the table (a new one must be documented).
    port_fields = {(name, f.name) for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
                   if f.name == "port" or f.name.endswith("_port")}
    assert port_fields <= set(by_option), port_fields - set(by_option)
    for (s, k), (port, shipped) in by_option.items():
        if (s, k) == ("etcd", "endpoints"):
            for name, raw in cluster_configs():
                assert all(e.endswith(f":{port}") for e in raw["etcd"]["endpoints"]), name
            continue
        value = int(shipped.strip("`"))
        assert port == str(value), (s, k, port, shipped)
        for name, raw in cluster_configs():
            assert raw.get(s, {}).get(k) == value, f"{name}: [{s}] {k} is not {value}"
    # The etcd ports are cluster.sh's defaults.
    script = (DEPLOY / "etcd/cluster.sh").read_text()
    assert '"${BASH_REMATCH[4]:-2379}"' in script and '"${BASH_REMATCH[5]:-2380}"' in script
    assert {"2379", "2380"} <= {row[0] for row in rows}


def test_the_fixed_store_port_is_below_the_ephemeral_range():
    """The README's reason why a fixed port is free: the kernel never hands it out."""
    low = 32768
    with contextlib.suppress(OSError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for name, raw in cluster_configs():
        assert 1024 <= raw["recovery"]["store_port"] < low, name


def test_every_env_variable_the_readme_names_is_an_override():
    named = set(re.findall(r"\b(ELASTICD_[A-Z_]+)\b", readme()))
    assert named >= {"ELASTICD_NODE_ID", "ELASTICD_NODE_ADDR", "ELASTICD_METRICS_ADDR",
                     "ELASTICD_ETCD_PASSWORD"}
    assert named <= set(ENV_OVERRIDES), named - set(ENV_OVERRIDES)


def elasticd_invocations(text: str) -> list[list[str]]:
    """``elasticd SUB --opt ...`` from the code blocks and inline code, as argument lists."""
    lines = [line for block in code_blocks(text) for line in block.splitlines()]
    lines += re.findall(r"`([^`\n]*elasticd [a-z][^`\n]*)`", text)
    found = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        while words and re.match(r"^[A-Z_]+=", words[0]):   # VAR=value elasticd ...
            words.pop(0)
        if len(words) > 1 and re.fullmatch(r"(\S*/)?(node-)?elasticd", words[0]) \
                and re.fullmatch(r"--version|[a-z]+", words[1]):
            found.append(words[1:])
    return found


def test_every_elasticd_command_the_readme_shows_exists():
    found = elasticd_invocations(readme())
    subcommands = {args[0] for args in found if not args[0].startswith("-")}
    assert {"run", "doctor", "status", "drain", "timeline"} <= subcommands, subcommands
    for args in found:
        if args[0] == "--version":
            continue
        command = cli.main.commands.get(args[0])
        assert command is not None, f"`elasticd {' '.join(args)}`: no command {args[0]!r}"
        known = {opt for p in command.params if isinstance(p, click.Option) for opt in p.opts}
        known.add("--help")   # click gives every command one (not among its params)
        for word in args[1:]:
            if word.startswith("--"):
                assert word.split("=")[0] in known, f"`elasticd {' '.join(args)}`: no option {word}"


@pytest.mark.parametrize(("name", "raw"), SHIPPED, ids=[n for n, _ in SHIPPED])
def test_every_shipped_config_loads_on_a_node(name, raw, certs, tmp_path):
    """With the node's env file of step 6 (the example's, plus the metrics address)."""
    path = tmp_path / "src" / "elasticd.toml"
    path.parent.mkdir()
    path.write_text(_dump(name))
    cluster = name.split(":")[-1].rsplit("/", 1)[-1] in CLUSTER
    env = read_env_file(ENV_EXAMPLE) if cluster else {}
    env["ELASTICD_METRICS_ADDR"] = "10.0.1.21"
    config = load_config(node_copy(path, certs, tmp_path), env=env)
    assert config.metrics.addr == "10.0.1.21"
    if cluster:
        assert config.recovery.store_port == 29450 and config.metrics.port == 9464
        assert config.node.addr == env["ELASTICD_NODE_ADDR"]


def _dump(name: str) -> str:
    """The shipped text of ``name`` (a deploy/config file, or cloud-init's copy of one)."""
    if ":" not in name:
        return (DEPLOY / "config" / name).read_text()
    user_data, path = name.split(":", 1)
    text = (DEPLOY / "cloud-init" / user_data).read_text()
    match = re.search(rf"^( *)# BEGIN {re.escape(path)}\n\1content: \|\n(.*?)^\1# END ", text,
                      re.MULTILINE | re.DOTALL)
    return "\n".join(line[len(match[1]) + 2:] for line in match[2].splitlines()) + "\n"


# -- steps 5 and 7: the unit -------------------------------------------------------------------


def test_the_unit_starts_the_job_in_its_code_directory():
    unit = parse_unit(UNITS / "elasticd.service")
    workdir = one(unit, "Service", "WorkingDirectory")
    assert workdir == TRAIN_DIR
    # Read-only to the job, and visible under the unit's sandbox.
    assert not any(workdir == p or workdir.startswith(p.rstrip("/") + "/") for p in writable_paths(unit))
    assert not workdir.startswith(("/home", "/root", "/tmp", "/var/tmp", "/run/user"))
    # The unit does not start without it: the README and cloud-init make it.
    assert f"install -d -m 0755 /opt/elasticd {TRAIN_DIR}" in readme()
    for user_data in sorted((DEPLOY / "cloud-init").glob("*.yaml")):
        assert f"install -d -m 0755 {TRAIN_DIR}\n" in user_data.read_text(), user_data.name


@pytest.mark.process
def test_the_unit_runs_the_venv_s_console_script(wheel):
    unit = parse_unit(UNITS / "elasticd.service")
    argv = one(unit, "Service", "ExecStart").split()
    assert argv[0] == f"{VENV}/bin/elasticd"
    assert f"python3 -m venv {VENV}" in readme()
    scripts = _entry_points(wheel)["console_scripts"]
    assert scripts[Path(argv[0]).name] == "elasticd.cli:main"
    assert argv[1] in cli.main.commands and argv[2] == "--config"


def test_type_notify_because_the_daemon_notifies():
    unit = parse_unit(UNITS / "elasticd.service")
    daemon = (REPO / "elasticd/daemon.py").read_text()
    notifies = "NOTIFY_SOCKET" in (REPO / "elasticd/sdnotify.py").read_text() and \
        "self.notifier.ready()" in daemon
    assert notifies
    assert one(unit, "Service", "Type") == "notify"


# -- steps 1 and 5: the wheel, installed -------------------------------------------------------


def _entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
        text = z.read(name).decode()
    groups: dict[str, dict[str, str]] = {}
    group = None
    for line in text.splitlines():
        if line.startswith("["):
            group = line.strip("[]")
            groups[group] = {}
        elif "=" in line and group:
            k, v = line.split("=", 1)
            groups[group][k.strip()] = v.strip()
    return groups


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Step 1, offline: ``pip wheel --no-deps`` from a copy of the sources."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(source, src / name)
    out = tmp / "dist"
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=180, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    wheels = list(out.glob("elasticd-*.whl"))
    assert [w.name for w in wheels] == [f"elasticd-{version}-py3-none-any.whl"]
    return wheels[0]


def _clean_env(**extra: str) -> dict[str, str]:
    """Our environment without PYTHONPATH (it would import the checkout, not the wheel)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """Step 5: a fresh venv with the wheel; its dependencies are this interpreter's."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin/python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                           "--no-index", "--quiet", str(wheel)],
                          capture_output=True, text=True, timeout=180, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=_clean_env()).stdout.strip()
    # After the venv's own site-packages: the wheel's elasticd wins over the checkout's.
    Path(site, "zz-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return root


def test_the_wheel_holds_what_the_deploy_configs_run(wheel):
    groups = _entry_points(wheel)
    assert groups["console_scripts"] == {"elasticd": "elasticd.cli:main"}
    assert groups["torchrun.handlers"]["etcd3"] == "elasticd.rendezvous:handler_factory"
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {n.split("/")[0] for n in names if "dist-info" not in n} == {"elasticd", "trainer",
                                                                       "checkpointing"}
    # The cluster configs' entrypoint is a module of the wheel.
    for name, raw in cluster_configs():
        module = raw["job"]["entrypoint"][1]
        assert raw["job"]["entrypoint"][0] == "-m" and f"{module.replace('.', '/')}.py" in names, name


@pytest.mark.process
def test_the_installed_entry_point_runs(venv, wheel):
    version = wheel.name.split("-")[1]
    # Not from the checkout's directory: `python -c` puts the working directory on sys.path.
    done = subprocess.run([str(venv / "bin/elasticd"), "--version"], capture_output=True, text=True,
                          timeout=60, env=_clean_env(), cwd=venv)
    assert done.returncode == 0 and version in done.stdout, done.stdout + done.stderr
    where = subprocess.run([str(venv / "bin/python"), "-c", "import elasticd; print(elasticd.__file__)"],
                           capture_output=True, text=True, timeout=60, env=_clean_env(), cwd=venv).stdout
    assert where.startswith(str(venv)), where


def _train_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A working directory like the unit's, with the code as a relative script (step 5),
    and the dev config pointed at it."""
    train = tmp_path / "train"
    train.mkdir()
    shutil.copy2(REPO / "trainer/examples/mlp.py", train / "train.py")
    text = (DEPLOY / "config/dev-single-machine.toml").read_text()
    assert '"trainer/examples/mlp.py"' in text
    config = tmp_path / "elasticd.toml"
    config.write_text(text.replace('"trainer/examples/mlp.py"', '"train.py"'))
    return train, config


def _node_env(etcd, job_id: str, tmp_path: Path) -> dict[str, str]:
    return _clean_env(ELASTICD_ETCD_ENDPOINTS=etcd.endpoint, ELASTICD_JOB_ID=job_id,
                      ELASTICD_NODE_ID="vm-a", ELASTICD_CHECKPOINT_DIR=str(tmp_path / "ckpt"),
                      TMPDIR=str(tmp_path))


@pytest.mark.process
def test_doctor_passes_from_the_installed_wheel(venv, fresh_etcd, tmp_path, job_id):
    """Step 7's check, from the venv, in the unit's kind of working directory."""
    train, config = _train_dir(tmp_path)
    done = subprocess.run([str(venv / "bin/elasticd"), "doctor", "--config", str(config)], cwd=train,
                          capture_output=True, text=True, timeout=120,
                          env=_node_env(fresh_etcd, job_id, tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAIL" not in done.stdout
    assert re.search(rf"torchrun entry point .*etcd3 .*\(for {re.escape(str(venv))}/bin/python",
                     done.stdout), done.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_installed_daemon_runs_a_relative_entrypoint(venv, fresh_etcd, tmp_path, job_id):
    """Steps 7-8 on one node: the installed daemon, started the unit's way (a notify socket,
    the working directory), finds the relative script there, says READY=1 and trains; a
    SIGTERM (systemctl stop, step 10) drains it to exit 0."""
    train, config = _train_dir(tmp_path)
    notify = NotifySocket(tmp_path / "notify.sock")
    received, until = notify.received, notify.until
    env = _node_env(fresh_etcd, job_id, tmp_path)
    env["NOTIFY_SOCKET"] = notify.path
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        daemon = subprocess.Popen([str(venv / "bin/elasticd"), "run", "--config", str(config)],
                                  cwd=train, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def tail() -> str:
            return log_path.read_text(errors="replace")[-3000:]

        assert until(lambda: "READY=1" in received, 120), tail()
        training = re.compile(r"STATUS=running: step [1-9]")
        assert until(lambda: any(training.match(m) for m in received), 120), (received[-5:], tail())
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=120) == 0, tail()
        assert (tmp_path / "ckpt").is_dir()
    finally:
        if daemon.poll() is None:
            proctree.kill_tree(daemon.pid)
            daemon.wait()
        notify.close()
