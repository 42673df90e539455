"""The one exception root of the trainer library.

torch errors are translated at the adapter that calls torch (``dist.py``,
``loop.py``) and nowhere else; every message says what to change.
"""


class TrainerError(Exception):
    """Root of every error the trainer library raises on purpose."""


class LaunchError(TrainerError):
    """The process was not started the way the library needs (e.g. outside torchrun)."""


class ConfigError(TrainerError):
    """A setting is invalid; the message names it, its value and the fix."""


class CheckpointMismatch(TrainerError):
    """A checkpoint does not fit the job being resumed (dataset size, agreed step)."""


class TrainingDiverged(TrainerError):
    """The agreed loss stayed non-finite: the model diverged. A restart from the last
    checkpoint would replay the same data on the same weights, so the worker exits
    with ``DIVERGED_EXIT_CODE`` and commits nothing of the diverged state."""
