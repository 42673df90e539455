"""ElasticContext.from_env: torchrun's variables, the ELASTICD_* contract, clear errors."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from trainer.context import ElasticContext
from trainer.errors import ConfigError, LaunchError

TORCHRUN = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_RUN_ID": "job7",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}

ELASTICD = {"ELASTICD_JOB_ID": "j", "ELASTICD_NODE_ID": "n1", "ELASTICD_CHECKPOINT_DIR": "/ck",
            "ELASTICD_CHECKPOINT_EVERY_STEPS": "100", "ELASTICD_CHECKPOINT_EVERY_S": "30.5",
            "ELASTICD_KEEP_LAST": "4", "ELASTICD_LR_RULE": "SQRT",
            "ELASTICD_LR_BASE_WORLD_SIZE": "8", "ELASTICD_LR_WARMUP_STEPS": "50",
            "ELASTICD_STOP_FILE": "/run/stop", "ELASTICD_PROGRESS_FILE": "/run/progress.json",
            "ELASTICD_DAEMON_PID": "1234"}


def test_reads_torchrun_and_elasticd_variables():
    ctx = ElasticContext.from_env({**TORCHRUN, **ELASTICD})
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (1, 1, 4, 2)
    assert (ctx.node_rank, ctx.restart_count, ctx.run_id) == (0, 3, "job7")
    assert (ctx.job_id, ctx.node_id, ctx.checkpoint_dir) == ("j", "n1", "/ck")
    assert (ctx.checkpoint_every_steps, ctx.checkpoint_every_s, ctx.keep_last) == (100, 30.5, 4)
    assert (ctx.lr_rule, ctx.lr_base_world_size, ctx.lr_warmup_steps) == ("sqrt", 8, 50)
    assert (ctx.stop_file, ctx.progress_file, ctx.daemon_pid) == ("/run/stop",
                                                                  "/run/progress.json", 1234)
    assert not ctx.is_rank0 and not ctx.is_local_rank0


def test_elasticd_variables_are_optional():
    ctx = ElasticContext.from_env(TORCHRUN)
    assert ctx.checkpoint_dir is None and ctx.daemon_pid is None and ctx.stop_file is None
    # The one default of elasticd.contract.settings (it was "none" here, "linear" in the daemon).
    assert (ctx.lr_rule, ctx.keep_last, ctx.lr_warmup_steps) == ("linear", 3, 0)


def test_outside_torchrun_names_missing_variables_and_how_to_launch():
    with pytest.raises(LaunchError) as err:
        ElasticContext.from_env({"RANK": "0"})
    msg = str(err.value)
    assert "LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in msg
    assert "torch.distributed.run" in msg and "--nproc-per-node" in msg


@pytest.mark.parametrize("name, value, fragment", [
    ("ELASTICD_CHECKPOINT_EVERY_STEPS", "ten", "ELASTICD_CHECKPOINT_EVERY_STEPS='ten'"),
    ("ELASTICD_LR_RULE", "cubic", "linear | sqrt | none"),
    ("ELASTICD_KEEP_LAST", "1", ">= 2"),
    ("RANK", "9", "0 <= RANK < 4"),
])
def test_invalid_values_name_the_variable(name, value, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("|", r"\|")):
        ElasticContext.from_env({**TORCHRUN, name: value})


def test_the_daemons_files_stay_where_its_environment_put_them_and_a_different_argument_warns():
    """Before: ``--progress-file`` moved the file the daemon reads (in-place recovery fell
    back to a restart, ``elasticd status`` showed no steps) and nothing said so."""
    env = {**TORCHRUN, "ELASTICD_PROGRESS_FILE": "/run/p.json", "ELASTICD_STOP_FILE": "/run/stop"}
    ctx = ElasticContext.from_env(env)
    with capture_logs() as logs:
        new = ctx.with_overrides(progress_file="/tmp/mine.json", stop_file="/run/stop",
                                 checkpoint_dir="/other")
    assert (new.progress_file, new.stop_file, new.checkpoint_dir) == ("/run/p.json", "/run/stop", "/other")
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"].startswith("--progress-file ignored: the daemon set ELASTICD_PROGRESS_FILE")
    assert (warning["given"], warning["kept"]) == ("/tmp/mine.json", "/run/p.json")
    alone = ElasticContext.from_env(TORCHRUN).with_overrides(progress_file="/tmp/mine.json")
    assert alone.progress_file == "/tmp/mine.json"   # no daemon: the argument decides


def test_arguments_override_the_environment_but_none_keeps_it():
    ctx = ElasticContext.from_env({**TORCHRUN, **ELASTICD})
    new = ctx.with_overrides(checkpoint_dir="/other", lr_rule=None, keep_last=None)
    assert (new.checkpoint_dir, new.lr_rule, new.keep_last) == ("/other", "sqrt", 4)
