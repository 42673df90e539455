"""trainer: the worker-side library of elasticd (works under plain torchrun too).

Elastic context from torchrun's environment, process-group set-up (NCCL on CUDA,
else gloo) with short timeouts, LR rescaling to the world size, an exactly-once
resumable sampler, coordinated stop, checkpoint cadence and resume. See
docs/trainer.md.

Exit codes (``trainer.exitcodes``, docs/trainer.md "Exit codes"): 0 complete, 75
stopped, 1 failed, 70 orphaned, 65 diverged, 78 unfit; the first four are re-exported
here, ``DIVERGED_EXIT_CODE`` and ``UNFIT_EXIT_CODE`` are in ``trainer.exitcodes``.

Names are imported lazily: ``import trainer`` and ``trainer.exitcodes`` do not import
torch; each other name imports its module (and torch) on first use. The daemon imports
none of this (it reads its workers' progress file, its agent's exit code and log), but
it does import torch itself (torch's rendezvous, through ``elasticd.rendezvous``).
"""

from __future__ import annotations

import importlib
from typing import Any

from trainer.errors import CheckpointMismatch, ConfigError, LaunchError, TrainerError
from trainer.exitcodes import (
    COMPLETE_EXIT_CODE,
    FAILURE_EXIT_CODE,
    ORPHAN_EXIT_CODE,
    STOP_EXIT_CODE,
    exit_worker,
)

_LAZY = {
    "ElasticContext": "trainer.context",
    "init_distributed": "trainer.dist",
    "wrap_ddp": "trainer.dist",
    "CollectiveError": "trainer.dist",
    "scale_lr": "trainer.lr",
    "LRScale": "trainer.lr",
    "plan_batches": "trainer.batching",
    "BatchPlan": "trainer.batching",
    "ElasticSampler": "trainer.sampler",
    "ElasticDistributedSampler": "trainer.distributed_sampler",
    "ElasticState": "trainer.elastic",
    "StopRequest": "trainer.stop",
    "OrphanWatchdog": "trainer.watchdog",
    "ProgressReporter": "trainer.progress",
    "ElasticTrainer": "trainer.loop",
    "TrainConfig": "trainer.loop",
    "dataset_batch_fn": "trainer.loop",
    "configure_logging": "trainer.logs",
}

__all__ = [
    "COMPLETE_EXIT_CODE",
    "FAILURE_EXIT_CODE",
    "ORPHAN_EXIT_CODE",
    "STOP_EXIT_CODE",
    "CheckpointMismatch",
    "ConfigError",
    "LaunchError",
    "TrainerError",
    "exit_worker",
    *_LAZY,
]


def __dir__() -> list[str]:
    # The lazy names are attributes too (``__getattr__`` imports them on first use):
    # without this, dir(trainer) and completion in a REPL hide ElasticTrainer and the rest.
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
