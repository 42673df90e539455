"""The example configs in deploy/config load with elasticd's own loader, as a node would
load them: with the per-node env file applied, and TLS files that exist.

load_config checks that the TLS files exist and the tests cannot write /etc/elasticd/tls,
so each example is loaded from a copy whose only change is that directory, pointing at
certificates made by deploy/etcd/make-certs.sh (test_only_the_tls_dir_differs proves the
copy is otherwise the file itself).
"""

from __future__ import annotations

import importlib.util
import re
import tomllib

import pytest

from elasticd.config import ENV_OVERRIDES, load_config
from elasticd.errors import ConfigError
from elasticd.preemption import GCE_NOTICE_WINDOW_S
from tests.deploy.conftest import CONFIGS, DEPLOY, NODE_TLS_DIR, REPO, node_copy, read_env_file

ENV_EXAMPLE = DEPLOY / "config/elasticd.env.example"
CLUSTER = ("multi-node-gpu.toml", "spot-preemptible.toml")
# Shutdown after the drain grace: up to one metadata poll before it, then the agent's stop
# and leaving etcd after it. GCE hard-stops the VM 30 s after the notice.
DRAIN_OVERHEAD_S = 6.0


def load(name: str, certs, tmp_path, env: dict[str, str] | None = None):
    path = node_copy(DEPLOY / "config" / name, certs, tmp_path)
    if env is None:
        env = read_env_file(ENV_EXAMPLE) if name in CLUSTER else {}
    return load_config(path, env=env)


def test_there_are_the_three_examples():
    assert {c.name for c in CONFIGS} == {"dev-single-machine.toml", *CLUSTER}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_example_loads(config, certs, tmp_path):
    c = load(config.name, certs, tmp_path)
    assert c.job.entrypoint and c.supervisor.drain_grace_s > 0


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_only_the_tls_dir_differs(config, certs, tmp_path):
    original = config.read_text()
    copy = node_copy(config, certs, tmp_path).read_text()
    assert copy.replace(f"{certs}/", NODE_TLS_DIR) == original
    for key in ("ca_cert", "cert", "key"):
        value = tomllib.loads(original).get("etcd", {}).get(key)
        assert value is None or value.startswith(NODE_TLS_DIR), (key, value)


def test_dev_single_machine(certs, tmp_path):
    c = load("dev-single-machine.toml", certs, tmp_path)
    assert c.etcd.endpoints == ("127.0.0.1:2379",) and not c.etcd.settings().secure
    assert (c.job.min_nodes, c.job.max_nodes, c.job.nproc_per_node) == (1, 3, 1)
    assert c.job.entrypoint[0] == "trainer/examples/mlp.py"
    assert (REPO / c.job.entrypoint[0]).is_file()
    assert c.metrics.port == 0   # several daemons share the machine
    # Each daemon on the machine gets its own id from the environment.
    assert load("dev-single-machine.toml", certs, tmp_path,
                {"ELASTICD_NODE_ID": "node-b"}).node.id == "node-b"


@pytest.mark.parametrize("name", CLUSTER)
def test_cluster_examples(name, certs, tmp_path):
    c = load(name, certs, tmp_path)
    env = read_env_file(ENV_EXAMPLE)
    assert len(c.etcd.endpoints) == 3
    assert c.etcd.ca_cert == f"{certs}/ca.pem" and c.etcd.cert == f"{certs}/client.pem"
    assert c.etcd.key == f"{certs}/client-key.pem"
    # One etcd user per job (deploy/etcd/setup-auth.sh): its role reaches that job only.
    assert (c.etcd.user, c.etcd.password) == (f"elasticd-{c.job.id}", env["ELASTICD_ETCD_PASSWORD"])
    assert (c.node.id, c.node.addr) == (env["ELASTICD_NODE_ID"], env["ELASTICD_NODE_ADDR"])
    assert c.job.nproc_per_node == "auto"
    assert c.checkpoint.dir.startswith("/mnt/shared/checkpoints/")
    assert (c.node.log_dir, c.node.run_dir) == ("/var/log/elasticd", "/run/elasticd")
    assert c.job.entrypoint[:2] == ("-m", "trainer.examples.charlm")
    assert importlib.util.find_spec("trainer.examples.charlm") is not None


@pytest.mark.parametrize("name", CLUSTER)
def test_the_etcd_password_is_not_in_the_file(name, certs, tmp_path):
    env = read_env_file(ENV_EXAMPLE)
    del env["ELASTICD_ETCD_PASSWORD"]
    with pytest.raises(ConfigError, match="both user and password"):
        load(name, certs, tmp_path, env)


def test_spot_drain_fits_in_the_gce_notice(certs, tmp_path):
    c = load("spot-preemptible.toml", certs, tmp_path)
    assert c.preemption.gce and c.preemption.aws
    assert c.supervisor.drain_grace_s + c.preemption.poll_interval_s + DRAIN_OVERHEAD_S \
        <= GCE_NOTICE_WINDOW_S
    assert c.job.min_nodes == 1   # any surviving node keeps training


@pytest.mark.parametrize("name", ["dev-single-machine.toml", *CLUSTER])
def test_entrypoint_arguments_are_accepted_by_the_example(name, monkeypatch):
    """Parse the entrypoint's arguments with the example's own parser, without training."""
    from trainer.examples import common

    entrypoint = tomllib.loads((DEPLOY / "config" / name).read_text())["job"]["entrypoint"]
    module = entrypoint[1] if entrypoint[0] == "-m" else \
        entrypoint[0].removesuffix(".py").replace("/", ".")
    argv = entrypoint[2:] if entrypoint[0] == "-m" else entrypoint[1:]

    class Parsed(Exception):
        pass

    def parse_only(parser, args=None):
        raise Parsed(parser.parse_args(args))

    monkeypatch.setattr(common, "parse", parse_only)
    with pytest.raises(Parsed):
        importlib.import_module(module).main(argv)


def test_env_example_sets_only_known_overrides():
    text = ENV_EXAMPLE.read_text()
    active = read_env_file(ENV_EXAMPLE)
    assert {"ELASTICD_NODE_ID", "ELASTICD_NODE_ADDR", "ELASTICD_ETCD_PASSWORD"} <= set(active)
    mentioned = set(re.findall(r"^#?(ELASTICD_[A-Z_]+)=", text, re.MULTILINE))
    assert mentioned == set(ENV_OVERRIDES), "document every override, and only those"
    others = set(re.findall(r"^#?([A-Z][A-Z0-9_]+)=", text, re.MULTILINE)) - mentioned
    assert all(v.startswith("NCCL_") for v in others), others


def _shipped_configs() -> list[tuple[str, dict]]:
    """Every config a node can get: deploy/config/*.toml and the copies cloud-init embeds."""
    out = [(c.name, tomllib.loads(c.read_text())) for c in CONFIGS]
    for user_data in sorted((DEPLOY / "cloud-init").glob("*.yaml")):
        for match in re.finditer(r"^( *)# BEGIN (\S+\.toml)\n\1content: \|\n(.*?)^\1# END \2\n",
                                 user_data.read_text(), re.MULTILINE | re.DOTALL):
            body = "\n".join(line[len(match[1]) + 2:] for line in match[3].splitlines())
            out.append((f"{user_data.name}:{match[2]}", tomllib.loads(body)))
    return out


SHIPPED = _shipped_configs()


def test_the_embedded_copies_are_found():
    assert any(":" in name for name, _ in SHIPPED), [name for name, _ in SHIPPED]


@pytest.mark.parametrize(("name", "raw"), SHIPPED, ids=[n for n, _ in SHIPPED])
def test_no_shipped_config_starves_torchrun_restarts(name, raw):
    """torchrun spends a restart on every membership change as well as on a crash: a small
    --max-restarts ends the job after a few preemptions (the daemon ends crash loops)."""
    restarts = raw.get("supervisor", {}).get("worker_restarts", 10000)
    assert restarts >= 1000, f"{name}: supervisor.worker_restarts = {restarts}; remove it (default 10000)"


@pytest.mark.parametrize(("name", "raw"), SHIPPED, ids=[n for n, _ in SHIPPED])
def test_no_shipped_config_exposes_metrics_on_every_interface(name, raw):
    metrics = raw.get("metrics", {})
    if metrics.get("port", 0):
        assert metrics.get("addr", "127.0.0.1") not in ("0.0.0.0", "::", ""), \
            f"{name}: metrics.addr = {metrics.get('addr')!r}; bind 127.0.0.1 or a private address"
