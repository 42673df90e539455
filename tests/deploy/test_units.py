"""The systemd units in deploy/systemd: `systemd-analyze verify`, and the properties the
daemon's drain, watchdog and GPU access depend on.

Known-harmless `verify` output (ALLOWED_VERIFY_LINES) is limited to what differs between
this test host and a node: the unit's users (elasticd, etcd) and the sibling units and
mounts it names may not exist here. Any other line fails the test, as does a non-zero exit.
systemd 252 prints nothing at all for these units.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from tests.deploy.conftest import CONFIGS, DEPLOY

UNITS = DEPLOY / "systemd"
ELASTICD_EXEC = "/opt/elasticd/venv/bin/elasticd"
ETCD_EXEC = "/usr/local/bin/etcd"
ALLOWED_VERIFY_LINES = (
    re.compile(r"(user|group) .*\b(elasticd|etcd)\b", re.IGNORECASE),
    re.compile(r"\b(etcd-member\.service|mnt-shared.*\.mount)\b"),
)
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    SYSTEMD_ANALYZE is None,
    reason="systemd-analyze not found: apt-get install systemd (Debian/Ubuntu) to verify units")


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """section -> key -> every value in order (keys like After= may repeat)."""
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path.name}: keep each setting on one line: {line}"
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep and section, f"{path.name}: not Key=value inside a section: {line}"
        sections[section][key.strip()].append(value.strip())
    return sections


def one(unit: dict, section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}= should be set once, found {values}"
    return values[0]


def seconds(span: str) -> float:
    """A systemd time span ("120s", "2min", "1min 30s", "90") in seconds."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "": 1}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", span):
        total += float(number) * units[unit]
    return total


def stub_copy(unit: Path, exec_path: str, tmp_path: Path) -> Path:
    """The unit with its ExecStart binary replaced by an executable stub (verify checks that
    the binary exists); every other line, User= included, is unchanged."""
    stub = tmp_path / "bin" / Path(exec_path).name
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = unit.read_text()
    assert f"ExecStart={exec_path}" in text
    copy = tmp_path / unit.name
    copy.write_text(text.replace(f"ExecStart={exec_path}", f"ExecStart={stub}"))
    return copy


def verify(unit: Path) -> tuple[int, list[str]]:
    out = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(unit)], capture_output=True,
                         text=True, timeout=60, cwd=unit.parent,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SYSTEMD_PAGER": ""})
    return out.returncode, [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


@needs_analyze
@pytest.mark.parametrize("name, exec_path", [("elasticd.service", ELASTICD_EXEC),
                                             ("etcd-member.service", ETCD_EXEC)])
def test_systemd_analyze_verify_passes(name, exec_path, tmp_path):
    code, lines = verify(stub_copy(UNITS / name, exec_path, tmp_path))
    unexpected = [line for line in lines if not any(p.search(line) for p in ALLOWED_VERIFY_LINES)]
    assert code == 0 and not unexpected, f"systemd-analyze verify {name}: exit {code}\n" + "\n".join(lines)


@needs_analyze
def test_verify_catches_a_broken_unit(tmp_path):
    """The check above is only worth something if verify reports mistakes here."""
    copy = stub_copy(UNITS / "elasticd.service", ELASTICD_EXEC, tmp_path)
    copy.write_text(copy.read_text().replace("Type=notify", "Type=notifyy")
                    .replace(f"ExecStart={tmp_path}/bin/elasticd", "ExecStart=/nonexistent/elasticd"))
    code, lines = verify(copy)
    assert code != 0
    assert any("notifyy" in line for line in lines), lines


def max_drain_grace_s() -> float:
    graces = [tomllib.loads(c.read_text()).get("supervisor", {}).get("drain_grace_s", 60.0)
              for c in CONFIGS]
    return max(graces)


def test_elasticd_unit_runs_the_daemon_as_systemd_expects():
    unit = parse_unit(UNITS / "elasticd.service")
    svc = unit["Service"]
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "ExecStart") == (
        f"{ELASTICD_EXEC} run --config /etc/elasticd/elasticd.toml")
    assert one(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"   # SIGHUP reload
    assert one(unit, "Service", "EnvironmentFile") == "-/etc/elasticd/elasticd.env"
    assert one(unit, "Service", "User") == "elasticd"
    assert one(unit, "Service", "Restart") == "always"
    assert seconds(one(unit, "Service", "RestartSec")) > 0
    # exit 0 = completed or deliberately drained: restarting would rejoin the job.
    assert one(unit, "Service", "RestartPreventExitStatus") == "0 3"   # 3 = node failed
    assert 10 <= seconds(one(unit, "Service", "WatchdogSec")) <= 120
    assert "WATCHDOG_USEC" not in " ".join(svc.get("Environment", []))


@pytest.mark.parametrize("config", [c for c in CONFIGS if "dev" not in c.name], ids=lambda c: c.name)
def test_the_unit_runs_the_workers_as_their_own_user_with_no_more_than_that_takes(config):
    """Issue 27: the shipped configs run the training code as elasticd-worker; the unit
    gives the daemon that user's group as its own (their files are each other's) and
    the key files' group beside it, and exactly the capabilities switching and signalling
    another user's processes take; it can see those processes (not ProtectProc=invisible)."""
    unit = parse_unit(UNITS / "elasticd.service")
    worker = tomllib.loads(config.read_text())["job"]["worker_user"]
    assert worker == "elasticd-worker"
    assert one(unit, "Service", "Group") == worker
    assert one(unit, "Service", "SupplementaryGroups") == "elasticd"
    needed = {"CAP_SETUID", "CAP_SETGID", "CAP_KILL"}
    assert set(one(unit, "Service", "AmbientCapabilities").split()) == needed
    assert set(one(unit, "Service", "CapabilityBoundingSet").split()) == needed
    assert one(unit, "Service", "ProtectProc") != "invisible"
    assert "/var/lib/elasticd-worker" in writable_paths(unit)   # the workers' HOME


def test_elasticd_unit_lets_the_drain_finish():
    unit = parse_unit(UNITS / "elasticd.service")
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "KillSignal") == "SIGTERM"
    stop_s = seconds(one(unit, "Service", "TimeoutStopSec"))
    # The drain grace, then the agent's stop and leaving etcd (the daemon's shutdown).
    assert stop_s >= max_drain_grace_s() + 30, (stop_s, max_drain_grace_s())
    assert one(unit, "Service", "OOMPolicy") == "continue"


def test_elasticd_unit_is_hardened_but_sees_gpus_and_network():
    unit = parse_unit(UNITS / "elasticd.service")
    svc = unit["Service"]
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "StateDirectory": "elasticd", "LogsDirectory": "elasticd",
                       "RuntimeDirectory": "elasticd"}.items():
        assert one(unit, "Service", key) == value, key
    # Any of these would hide /dev/nvidia* or the network from CUDA and NCCL.
    for key in ("PrivateDevices", "ProtectClock", "PrivateNetwork"):
        assert svc.get(key, ["no"]) == ["no"], f"{key}= must stay off (see the unit's comments)"
    for key in ("DeviceAllow", "DevicePolicy", "IPAddressDeny", "RestrictAddressFamilies"):
        assert key not in svc, f"{key}= must not be set (see the unit's comments)"
    for key in ("After", "Wants"):
        assert "network-online.target" in " ".join(unit["Unit"][key])
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def writable_paths(unit: dict) -> list[str]:
    svc = unit["Service"]
    paths = [f"/var/lib/{one(unit, 'Service', 'StateDirectory')}",
             f"/var/log/{one(unit, 'Service', 'LogsDirectory')}",
             f"/run/{one(unit, 'Service', 'RuntimeDirectory')}"]
    for entry in svc.get("ReadWritePaths", []):
        paths += [p.lstrip("-") for p in entry.split()]
    return paths


@pytest.mark.parametrize("config", [c for c in CONFIGS if "dev" not in c.name], ids=lambda c: c.name)
def test_config_dirs_are_writable_under_the_unit(config):
    """ProtectSystem=strict makes every other path read-only: the daemon, workers and
    checkpoints must write only where the unit allows."""
    unit = parse_unit(UNITS / "elasticd.service")
    allowed = writable_paths(unit)
    raw = tomllib.loads(config.read_text())
    wanted = [raw["checkpoint"]["dir"], raw["node"]["log_dir"], raw["node"]["run_dir"]]
    for path in wanted:
        assert any(path == a or path.startswith(a.rstrip("/") + "/") for a in allowed), (path, allowed)
    # Shared storage must be mounted before the daemon writes a checkpoint under it.
    mounts = " ".join(unit["Unit"].get("RequiresMountsFor", []))
    assert raw["checkpoint"]["dir"].startswith(mounts.split()[0] + "/")


def test_etcd_unit():
    unit = parse_unit(UNITS / "etcd-member.service")
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "ExecStart") == ETCD_EXEC   # every flag comes from the env file
    assert one(unit, "Service", "EnvironmentFile") == "/etc/etcd/etcd.env"
    assert one(unit, "Service", "User") == "etcd"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert int(one(unit, "Service", "LimitNOFILE")) >= 65536
    # cluster.sh's default ETCD_DATA_DIR is the unit's StateDirectory.
    assert one(unit, "Service", "StateDirectory") == "etcd"
    assert "ETCD_DATA_DIR:-/var/lib/etcd}" in (DEPLOY / "etcd/cluster.sh").read_text()
    assert one(unit, "Service", "StateDirectoryMode") == "0700"
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "PrivateDevices"):
        assert one(unit, "Service", key) == "yes", key
    assert one(unit, "Service", "ProtectSystem") == "strict"
