"""The worker contract (elasticd/contract/settings.py): one definition, both sides agree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.config import LR_RULES as CONFIG_LR_RULES
from elasticd.config import CheckpointConfig, LrConfig
from elasticd.contract import settings as worker_contract
from elasticd.contract.settings import (
    DEFAULT_LR_RULE,
    FIELDS,
    LR_RULES,
    WorkerContractError,
    WorkerSettings,
)
from elasticd.errors import ConfigError as DaemonConfigError
from trainer.context import ElasticContext
from trainer.examples.common import parser

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                min_size=1).filter(lambda s: s.strip() != "")
_STRATEGIES = {str: _TEXT, int: st.integers(1, 2**62),
               float: st.floats(min_value=1e-9, max_value=1e12, allow_nan=False)}


def _strategy(f: dataclasses.Field):
    meta = f.metadata
    if meta["choices"]:
        return st.sampled_from(meta["choices"])
    if f.name == "keep_last":
        return st.integers(worker_contract.MIN_KEEP_LAST, 1000)
    if f.name == "lr_warmup_steps":
        return st.integers(0, 10**6)
    if f.name == "joining":
        return st.integers(0, 1)
    base = _STRATEGIES[meta["kind"]]
    return base if f.default is not None else st.none() | base


# Every field gets a strategy from its declaration, so a new setting is covered without edits.
SETTINGS = st.builds(WorkerSettings, **{f.name: _strategy(f) for f in FIELDS})


@pytest.mark.process
@given(SETTINGS)
def test_to_env_from_env_round_trips(settings):
    env = settings.to_env()
    assert all(k.startswith("ELASTICD_") and isinstance(v, str) for k, v in env.items())
    assert WorkerSettings.from_env(env) == settings
    assert not any("\x00" in v for v in env.values())  # an environment can carry it


def test_unset_variables_give_the_documented_defaults():
    assert WorkerSettings.from_env({}) == WorkerSettings()
    assert WorkerSettings().lr_rule == DEFAULT_LR_RULE == "linear"
    assert WorkerSettings().keep_last == worker_contract.DEFAULT_KEEP_LAST == 3
    assert WorkerSettings.from_env({"ELASTICD_KEEP_LAST": "  ", "ELASTICD_JOB_ID": ""}) == \
        WorkerSettings()


def test_daemon_and_worker_share_the_rules():
    assert CONFIG_LR_RULES is LR_RULES
    assert LrConfig().rule == DEFAULT_LR_RULE  # one default on both sides
    with pytest.raises(DaemonConfigError, match="keep at least 2"):
        CheckpointConfig(keep_last=1)
    with pytest.raises(WorkerContractError, match=">= 2"):
        WorkerSettings(keep_last=1)
    for bad in (True, 2.0, "3"):
        assert not worker_contract.is_valid_keep_last(bad)


@pytest.mark.parametrize("name, value, fragment", [
    ("ELASTICD_KEEP_LAST", "1", "ELASTICD_KEEP_LAST=1 is invalid: expected an integer >= 2"),
    ("ELASTICD_KEEP_LAST", "three", "ELASTICD_KEEP_LAST='three' is not a valid int"),
    ("ELASTICD_LR_RULE", "cubic", "expected linear | sqrt | none"),
    ("ELASTICD_CHECKPOINT_EVERY_S", "inf", "expected a number > 0"),
    ("ELASTICD_CHECKPOINT_EVERY_STEPS", "0", "expected an integer >= 1"),
    ("ELASTICD_DAEMON_PID", "-3", "a positive pid"),
])
def test_errors_name_the_variable_its_flag_and_the_fix(name, value, fragment):
    with pytest.raises(WorkerContractError) as err:
        WorkerSettings.from_env({name: value})
    flag = "--" + name.removeprefix("ELASTICD_").lower().replace("_", "-")
    assert fragment in str(err.value) and f"(or {flag})" in str(err.value)


def test_wrong_types_are_refused_when_constructed():
    with pytest.raises(WorkerContractError, match="ELASTICD_KEEP_LAST=True"):
        WorkerSettings(keep_last=True)
    with pytest.raises(WorkerContractError, match="ELASTICD_STOP_FILE"):
        WorkerSettings(stop_file="a\x00b")  # an environment cannot carry it
    assert WorkerSettings(checkpoint_every_s=30).checkpoint_every_s == 30.0


def test_the_context_is_the_contract_plus_torchruns_variables():
    contract = {f.name for f in FIELDS}
    assert contract <= {f.name for f in dataclasses.fields(ElasticContext)}
    ctx = ElasticContext.single_process(keep_last=5, lr_rule="sqrt")
    assert ctx.settings == WorkerSettings(keep_last=5, lr_rule="sqrt")


def test_example_flags_are_generated_from_the_contract():
    args = parser("x", batch_size=1, lr=0.1).parse_args([])
    for f in FIELDS:
        assert getattr(args, f.name) is None  # unset: the environment decides
    given_args = ["--keep-last", "4", "--lr-rule", "sqrt", "--checkpoint-every-s", "2.5",
                  "--stop-file", "/s"]
    args = parser("x", batch_size=1, lr=0.1).parse_args(given_args)
    assert (args.keep_last, args.lr_rule, args.checkpoint_every_s, args.stop_file) == \
        (4, "sqrt", 2.5, "/s")
    with pytest.raises(SystemExit):
        parser("x", batch_size=1, lr=0.1).parse_args(["--keep-last", "1"])


def test_importing_the_contract_imports_neither_torch_nor_trainer():
    code = ("import sys, elasticd.contract.settings; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'trainer')]; "
            "sys.exit(str(bad) if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr


def test_dir_of_trainer_lists_its_lazy_names_without_importing_them():
    code = ("import sys, trainer; names = dir(trainer); "
            "missing = [n for n in trainer.__all__ if n not in names]; "
            "loaded = [m for m in sys.modules if m.split('.')[0] == 'torch']; "
            "sys.exit(f'missing {missing}, imported {loaded[:3]}' if missing or loaded else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
