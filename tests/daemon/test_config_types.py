"""Wrong-typed config values: the error names the section, the key, the value, the
expected type and the fix (never a bare TypeError or "[section] is incomplete")."""

from __future__ import annotations

import pytest

from elasticd.config import config_from_dict, load_config
from elasticd.errors import ConfigError
from tests.daemon.test_config import BASE
from tests.daemon.test_config import cfg as build


@pytest.mark.parametrize(("section", "key", "value", "words"), [
    ("job", "min_nodes", "two", ["[job] min_nodes = 'two'", "(str)", "expected a whole number",
                                 "min_nodes = 2"]),
    ("job", "min_nodes", "2", ["[job] min_nodes = '2'", "write it without quotes: min_nodes = 2"]),
    ("job", "max_nodes", True, ["[job] max_nodes = True", "(bool)", "a whole number"]),
    ("job", "id", ["demo"], ["[job] id = ['demo']", "(list)", "expected a string",
                             'write the one value, not a list: id = "demo"']),
    ("job", "entrypoint", "train.py", ["[job] entrypoint = 'train.py'", "a list of strings",
                                       'write it as a list: entrypoint = ["train.py"]']),
    ("job", "entrypoint", ["train.py", 3], ["[job] entrypoint", "a list of strings"]),
    ("job", "nproc_per_node", 1.5, ["[job] nproc_per_node = 1.5", "a whole number or a string"]),
    ("node", "probe_interval_s", "fast", ["[node] probe_interval_s = 'fast'", "expected a number",
                                          "probe_interval_s = 1.5"]),
    ("node", "addr", ["10.0.0.1", "10.0.0.2"], ["[node] addr", "expected a string", 'addr = "..."']),
    ("checkpoint", "every_s", "600", ["[checkpoint] every_s = '600'", "every_s = 600"]),
    ("supervisor", "drain_grace_s", [30], ["[supervisor] drain_grace_s = [30]",
                                          "not a list: drain_grace_s = 30"]),
    ("etcd", "endpoints", "10.0.0.1:2379", ["[etcd] endpoints", "a list of strings",
                                            'endpoints = ["10.0.0.1:2379"]']),
    ("etcd", "timeout_s", "5s", ["[etcd] timeout_s = '5s'", "expected a number"]),
    ("preemption", "gce", "yes", ["[preemption] gce = 'yes'", "true or false"]),
    ("metrics", "port", "9464", ["[metrics] port = '9464'", "port = 9464"]),
])
def test_wrong_type_names_key_value_type_and_fix(section, key, value, words):
    with pytest.raises(ConfigError) as info:
        build(**{section: {key: value}})
    message = str(info.value)
    assert "incomplete" not in message and "TypeError" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_whole_seconds_are_fine_where_seconds_may_be_fractional():
    c = build(node={"probe_interval_s": 1}, checkpoint={"every_s": 600}, supervisor={"drain_grace_s": 30})
    assert (c.node.probe_interval_s, c.checkpoint.every_s, c.supervisor.drain_grace_s) == (1, 600, 30)


def test_auto_is_still_a_valid_nproc():
    assert build(job={"nproc_per_node": "auto"}).job.nproc_per_node == "auto"


@pytest.mark.parametrize("missing", ["id", "entrypoint"])
def test_a_missing_required_key_is_named(missing):
    job = {k: v for k, v in BASE["job"].items() if k != missing}
    pattern = rf"\[job\] is incomplete: the required key\(s\) {missing} are missing"
    with pytest.raises(ConfigError, match=pattern):
        config_from_dict({"job": job})


def test_from_a_toml_file(tmp_path):
    """As an operator meets it: the file's path, then the key and the fix."""
    path = tmp_path / "node.toml"
    path.write_text('[job]\nid = "demo"\nentrypoint = ["train.py"]\nmin_nodes = "two"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert "[job] min_nodes = 'two' has the wrong type (str); expected a whole number" in str(info.value)
