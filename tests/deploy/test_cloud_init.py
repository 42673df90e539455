"""The cloud-init user-data for spot nodes (deploy/cloud-init/*.yaml).

Always: the `#cloud-config` header, the top-level modules, the embedded copies of the unit
and the spot config are current (sync.py --check), and the embedded bootstrap script
passes `bash -n` (and shellcheck, where installed). With PyYAML importable: the document
parses and its write_files, users and runcmd say what the node needs. The venv has no
PyYAML and the project adds no dependency for it, so there those assertions are skipped.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from elasticd.config import load_config
from tests.deploy.conftest import DEPLOY, REPO, node_copy

USER_DATA = sorted((DEPLOY / "cloud-init").glob("*.yaml"))
CLOUDS = {"gce-spot.yaml": ("gce", "aws"), "aws-spot.yaml": ("aws", "gce")}  # (kept, turned off)
BOOTSTRAP = "/usr/local/sbin/elasticd-bootstrap"

try:
    import yaml
except ImportError:
    yaml = None
needs_yaml = pytest.mark.skipif(yaml is None, reason="PyYAML is not importable (not a dependency)")


def sync_module():
    spec = importlib.util.spec_from_file_location("deploy_cloud_init_sync",
                                                  DEPLOY / "cloud-init/sync.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def literal_block(text: str, path: str) -> str:
    """The ``content: |`` of the write_files entry for ``path``, without a YAML parser."""
    lines = text.splitlines()
    start = lines.index(f"  - path: {path}")
    at = next(i for i in range(start, len(lines)) if lines[i].strip() == "content: |") + 1
    body = []
    for line in lines[at:]:
        if line and not line.startswith("      "):
            break
        body.append(line[6:])
    return "\n".join(body).rstrip("\n") + "\n"


def test_there_is_one_per_cloud():
    assert {p.name for p in USER_DATA} == set(CLOUDS)


@pytest.mark.parametrize("user_data", USER_DATA, ids=lambda p: p.name)
def test_header_and_modules(user_data):
    text = user_data.read_text()
    assert text.splitlines()[0] == "#cloud-config"
    for module in ("write_files", "users", "runcmd", "packages"):
        assert re.search(rf"^{module}:", text, re.MULTILINE), module


def test_embedded_copies_are_current():
    sync = sync_module()
    for path in USER_DATA:
        text = path.read_text()
        assert sync.render(text) == text, f"{path.name} is stale: run deploy/cloud-init/sync.py"
        assert "# BEGIN deploy/systemd/elasticd.service" in text
        assert "# BEGIN deploy/config/spot-preemptible.toml" in text


@pytest.mark.parametrize("user_data", USER_DATA, ids=lambda p: p.name)
def test_bootstrap_script(user_data, tmp_path):
    script = literal_block(user_data.read_text(), BOOTSTRAP)
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script and "usage:" in script
    # torch pinned first, then the package: a bare torch requirement would float.
    assert script.index('"torch==$TORCH_VERSION"') < script.index('"$ELASTICD_PACKAGE"')
    assert '"$PYTHON" -m venv "$venv"' in script and "venv=/opt/elasticd/venv" in script
    for var in ("ELASTICD_NODE_ID", "ELASTICD_NODE_ADDR", "ELASTICD_ETCD_PASSWORD"):
        assert f'echo "{var}=' in script, var
    assert ">/etc/elasticd/elasticd.env" in script
    assert script.rstrip().endswith("systemctl enable --now elasticd.service")
    path = tmp_path / "bootstrap.sh"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck"):
        done = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


@pytest.mark.parametrize("user_data", USER_DATA, ids=lambda p: p.name)
def test_install_variables(user_data):
    env = dict(line.split("=", 1) for line in
               literal_block(user_data.read_text(), "/etc/elasticd/install.env").splitlines()
               if line and not line.startswith("#"))
    wanted = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_range = next(d for d in wanted if d.startswith("torch")).removeprefix("torch")
    assert env["TORCH_VERSION"] in SpecifierSet(torch_range)
    assert env["ELASTICD_PACKAGE"]
    assert len(env["ELASTICD_ETCD_ENDPOINTS"].split(",")) == 3


@pytest.mark.process
@pytest.mark.parametrize("user_data", USER_DATA, ids=lambda p: p.name)
def test_each_cloud_watches_its_own_notices(user_data, certs, tmp_path):
    """The bootstrap's sed turns off the other cloud's watcher in the spot config."""
    kept, off = CLOUDS[user_data.name]
    script = literal_block(user_data.read_text(), BOOTSTRAP)
    expr = re.search(r"sed -i 's/\^(\w+) = true\$/(\w+) = false/' /etc/elasticd/elasticd.toml", script)
    assert expr and expr[1] == expr[2] == off
    spot = DEPLOY / "config/spot-preemptible.toml"
    text, count = re.subn(rf"^{off} = true$", f"{off} = false", spot.read_text(), flags=re.MULTILINE)
    assert count == 1
    edited = tmp_path / "edited" / spot.name
    edited.parent.mkdir()
    edited.write_text(text)
    config = load_config(node_copy(edited, certs, tmp_path), env={"ELASTICD_ETCD_PASSWORD": "x"})
    assert getattr(config.preemption, kept) and not getattr(config.preemption, off)


@needs_yaml
@pytest.mark.parametrize("user_data", USER_DATA, ids=lambda p: p.name)
def test_parsed_user_data(user_data):
    doc = yaml.safe_load(user_data.read_text())
    files = {f["path"]: f for f in doc["write_files"]}
    assert files["/etc/systemd/system/elasticd.service"]["content"] == \
        (DEPLOY / "systemd/elasticd.service").read_text()
    assert files["/etc/elasticd/elasticd.toml"]["content"] == \
        (DEPLOY / "config/spot-preemptible.toml").read_text()
    assert files[BOOTSTRAP]["permissions"] == "0755"
    assert doc["runcmd"] == [[BOOTSTRAP]]
    users = {u["name"]: u for u in doc["users"] if isinstance(u, dict)}
    assert "default" in doc["users"]   # keep the image's login user
    assert users["elasticd"]["homedir"] == "/var/lib/elasticd"
    assert isinstance(users["elasticd"]["uid"], int)
    # The training code's own user ([job] worker_user), a uid of its own.
    assert users["elasticd-worker"]["homedir"] == "/var/lib/elasticd-worker"
    assert users["elasticd-worker"]["uid"] != users["elasticd"]["uid"]
    assert "python3-venv" in doc["packages"]


def test_literal_block_reader_matches_the_file(tmp_path):
    """The text reader above agrees with the embedding (so the checks without PyYAML hold)."""
    for path in USER_DATA:
        text = path.read_text()
        assert literal_block(text, "/etc/systemd/system/elasticd.service") == \
            (DEPLOY / "systemd/elasticd.service").read_text()
        assert Path(BOOTSTRAP).name in text


@pytest.mark.parametrize("user_data", USER_DATA, ids=lambda p: p.name)
def test_cloud_init_schema(user_data):
    """cloud-init's own schema check, where cloud-init is importable (not in the venv)."""
    schema = pytest.importorskip("cloudinit.config.schema", reason="cloud-init is not importable")
    schema.validate_cloudconfig_file(str(user_data), schema.get_schema())
