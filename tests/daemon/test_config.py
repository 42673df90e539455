"""Config validation: every error names the key, the value and the fix."""

from __future__ import annotations

import pytest

from elasticd.config import config_from_dict, load_config
from elasticd.errors import ConfigError

BASE = {"job": {"id": "demo", "entrypoint": ["train.py"], "min_nodes": 1, "max_nodes": 3}}


def cfg(**sections):
    raw = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def test_minimal_config_has_sane_defaults():
    c = cfg()
    assert c.node.lease_ttl_s == 5
    assert c.rendezvous.last_call_timeout == 1 and c.rendezvous.rounds == "keyed"
    assert c.etcd.endpoints == ("127.0.0.1:2379",)
    assert c.checkpoint.keep_last == 3
    assert (c.recovery.mode, c.recovery.bound_s, c.recovery.store_port) == ("in-place", 5.0, 0)
    assert c.recovery.reform == "auto"


@pytest.mark.parametrize("sections, message", [
    ({"job": {"id": "Bad Id"}}, "job id 'Bad Id' is not valid"),
    ({"job": {"entrypoint": []}}, "job.entrypoint"),
    ({"job": {"min_nodes": 0}}, "job.min_nodes = 0 is not valid"),
    ({"job": {"max_nodes": 0}}, "job.max_nodes = 0 is not valid: use a whole number >= job.min_nodes"),
    ({"job": {"nproc_per_node": "many"}}, 'use a whole number >= 1 or "auto"'),
    ({"node": {"lease_ttl_s": 1}}, "node.lease_ttl_s = 1 is not valid"),
    ({"node": {"lease_ttl_s": 2, "probe_interval_s": 3}}, "node.probe_interval_s"),
    ({"rendezvous": {"keep_alive_interval": 1, "keep_alive_max_attempt": 2}}, "split brain"),
    ({"rendezvous": {"last_call_timeout": 0}}, "rendezvous.last_call_timeout = 0"),
    ({"checkpoint": {"keep_last": 1}}, "keep at least 2"),
    ({"lr": {"rule": "cubic"}}, "use one of linear, sqrt, none"),
    ({"etcd": {"endpoints": ["host:notaport"]}}, "bad port"),
    ({"etcd": {"user": "root"}}, "both user and password"),
    ({"etcd": {"ca_cert": "/nonexistent.pem"}}, "no such file"),
    ({"supervisor": {"backoff_initial_s": 100, "backoff_max_s": 10}}, "supervisor.backoff_initial_s"),
    ({"supervisor": {"start_timeout_s": 0}}, "longer than your workers' start-up"),
    ({"supervisor": {"broken_round_grace_s": 0}}, "supervisor.broken_round_grace_s = 0"),
    ({"job": {"colour": "red"}}, "[job] has unknown key(s) ['colour']"),
    ({"jobs": {"id": "x"}}, "unknown section(s) ['jobs']"),
    ({"recovery": {"mode": "inplace"}}, "recovery.mode = 'inplace' is not valid: use one of 'in-place'"),
    ({"recovery": {"bound_s": 0}}, "recovery.bound_s = 0 is not valid"),
    ({"recovery": {"store_port": 70000}}, "recovery.store_port = 70000 is not valid: use 0"),
    ({"recovery": {"reform": "reconfigure"}},
     "recovery.reform = 'reconfigure' is not valid: use one of 'auto', 'destroy-init'"),
    ({"recovery": {"bound_s": "5"}}, "write it without quotes: bound_s = 5"),
])
def test_bad_values_are_named_with_a_fix(sections, message):
    with pytest.raises(ConfigError) as info:
        cfg(**sections)
    assert message in str(info.value)


def test_missing_job_section():
    with pytest.raises(ConfigError, match=r"the \[job\] section is required"):
        config_from_dict({"node": {"id": "a"}})


def test_env_overrides_per_node_values_and_secrets(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[job]\nid = "demo"\nentrypoint = ["t.py"]\n[etcd]\nuser = "u"\npassword = "file"\n')
    c = load_config(path, env={"ELASTICD_NODE_ID": "node-7", "ELASTICD_ETCD_PASSWORD": "pw-s3cr3t",
                               "ELASTICD_ETCD_ENDPOINTS": "10.0.0.1:2379, 10.0.0.2:2379"})
    assert c.node.id == "node-7"
    assert c.etcd.password == "pw-s3cr3t"
    assert c.etcd.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379")
    assert "pw-s3cr3t" not in repr(c)   # (not "secret": [recovery] secret_file is a path)


def test_env_overrides_the_metrics_bind_address(tmp_path):
    """One shared file binds loopback; each node's env file names its own private address."""
    path = tmp_path / "c.toml"
    path.write_text('[job]\nid = "demo"\nentrypoint = ["t.py"]\n[metrics]\nport = 9464\n'
                    'addr = "127.0.0.1"\n')
    assert load_config(path, env={}).metrics.addr == "127.0.0.1"
    c = load_config(path, env={"ELASTICD_METRICS_ADDR": "10.0.1.21"})
    assert (c.metrics.addr, c.metrics.port) == ("10.0.1.21", 9464)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[job\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")


def test_the_recovery_mode_is_one_enum_with_one_default():
    from elasticd.contract.settings import DEFAULT_RECOVERY, RecoveryMode
    from elasticd.daemon import policy_from
    from elasticd.supervisor import Policy

    c = config_from_dict(BASE)
    assert c.recovery.mode is DEFAULT_RECOVERY is RecoveryMode.IN_PLACE
    assert Policy().recovery_mode is DEFAULT_RECOVERY
    restart = config_from_dict({**BASE, "recovery": {"mode": "restart"}})
    assert restart.recovery.mode is RecoveryMode.RESTART   # the TOML text becomes the enum
    assert policy_from(restart).recovery_mode is RecoveryMode.RESTART
