"""The README's plain-torchrun example works as written (only the etcd endpoint and the
checkpoint dir are pointed at this test's own)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def readme_torchrun_command() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"^torchrun --rdzv-backend=etcd3.*?(?<!\\)\n", text, re.S | re.M).group(0)
    return shlex.split(block.replace("\\\n", " "))


@pytest.mark.timeout(300)
def test_readme_plain_torchrun_example(etcd_server, tmp_path):
    argv = readme_torchrun_command()
    assert argv[0] == "torchrun"
    argv = [a.replace("127.0.0.1:2379", etcd_server.endpoint).replace("/tmp/ckpt", str(tmp_path / "ck"))
            for a in argv[1:]]
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    logs = [open(tmp_path / f"node{i}.log", "wb") for i in range(2)]  # noqa: SIM115
    nodes = [subprocess.Popen([torchrun, *argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
             for log in logs]
    codes = [n.wait(timeout=240) for n in nodes]
    for log in logs:
        log.close()
    out = (tmp_path / "node0.log").read_text()
    assert codes == [0, 0], out[-3000:]
    assert "in a world of size 2" in out
    assert (tmp_path / "ck").exists()


def test_readme_names_every_environment_override():
    """The Configuration section's list of overrides is config.ENV_OVERRIDES, all of it
    (ELASTICD_METRICS_ADDR was missing from it)."""
    from elasticd.config import ENV_OVERRIDES

    text = (REPO / "README.md").read_text()
    listed = text.split("Environment overrides for per-node values and secrets:", 1)[1]
    listed = listed.split("SIGHUP", 1)[0]
    missing = [name for name in ENV_OVERRIDES if f"`{name}`" not in listed]
    assert not missing, f"README's environment overrides lack {missing}"
