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

from tests.conftest import etcdctl

REPO = Path(__file__).resolve().parents[1]


def readme_torchrun_command() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"^torchrun --rdzv-backend=etcd3.*?(?<!\\)\n", text, re.S | re.M).group(0)
    return shlex.split(block.replace("\\\n", " "))


def run_readme_example(etcd_server, tmp_path: Path, run_id: str, nodes: int = 2,
                       name: str = "node") -> list[tuple[int, str]]:
    """The README's command on ``nodes`` agents at once, each agent's exit code and output.

    Only the etcd endpoint, the checkpoint dir (``tmp_path/ck``) and the run id change: the
    session's etcd is shared, and a README id (job1) another test completed stays closed."""
    argv = readme_torchrun_command()
    assert argv[0] == "torchrun"
    argv = [a.replace("127.0.0.1:2379", etcd_server.endpoint).replace("/tmp/ckpt", str(tmp_path / "ck"))
            .replace("--rdzv-id=job1", f"--rdzv-id={run_id}") for a in argv[1:]]
    assert f"--rdzv-id={run_id}" in argv
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [tmp_path / f"{name}{i}.log" for i in range(nodes)]
    logs = [open(path, "wb") for path in paths]  # noqa: SIM115
    procs = [subprocess.Popen([torchrun, *argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
             for log in logs]
    codes = [p.wait(timeout=240) for p in procs]
    for log in logs:
        log.close()
    return [(code, path.read_text()) for code, path in zip(codes, paths, strict=True)]


@pytest.mark.process
@pytest.mark.timeout(300)
def test_readme_plain_torchrun_example(etcd_server, tmp_path, job_id):
    runs = run_readme_example(etcd_server, tmp_path, job_id)
    out = runs[0][1]
    assert [code for code, _ in runs] == [0, 0], out[-3000:]
    assert "in a world of size 2" in out
    assert (tmp_path / "ck").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rerunning_the_readme_example_with_its_run_id_says_it_completed_and_the_fix(
        etcd_server, tmp_path, job_id):
    """Run the README's command, then again with the same --rdzv-id: the rendezvous that the
    first run closed refuses it, and the agent's last line says why and the fix, which works."""
    [(first, out)] = run_readme_example(etcd_server, tmp_path, job_id, nodes=1, name="first")
    assert first == 0, out[-3000:]
    [(second, out)] = run_readme_example(etcd_server, tmp_path, job_id, nodes=1, name="second")
    assert second != 0, out[-3000:]
    # torchrun's last line is the error's own text: the rest of the output is its traceback.
    last = out.rstrip().splitlines()[-1]
    delete = f"etcdctl --endpoints={etcd_server.endpoint} del --prefix /elasticd/{job_id}/"
    assert last.startswith(f"torch.distributed.elastic.rendezvous.api.RendezvousClosedError: the "
                           f"rendezvous of run '{job_id}' is closed: a run with this id completed"), last
    assert "Start the next run with a new --rdzv-id" in last, last
    assert last.endswith(f"with every agent stopped: {delete}"), last
    assert "leaving the rendezvous open" not in out, "a closed rendezvous is not left open"
    # The fix as printed: delete the keys, and the same command runs (and resumes from the
    # first run's checkpoint).
    command = shlex.split(delete)
    etcdctl(etcd_server, *command[2:])
    [(third, out)] = run_readme_example(etcd_server, tmp_path, job_id, nodes=1, name="third")
    assert third == 0, out[-3000:]


def test_readme_names_every_environment_override():
    """The Configuration section's list of overrides is config.ENV_OVERRIDES, all of it
    (ELASTICD_METRICS_ADDR was missing from it)."""
    from elasticd.config import ENV_OVERRIDES

    text = (REPO / "README.md").read_text()
    listed = text.split("Environment overrides for per-node values and secrets:", 1)[1]
    listed = listed.split("SIGHUP", 1)[0]
    missing = [name for name in ENV_OVERRIDES if f"`{name}`" not in listed]
    assert not missing, f"README's environment overrides lack {missing}"
