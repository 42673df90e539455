"""Who this worker is and what the daemon asked of it, read once from the environment.

Two sources, both optional beyond torchrun's own variables:

* torchrun's worker environment (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, ...);
* the ``ELASTICD_*`` contract set by the elasticd daemon, defined once in
  ``elasticd.contract.settings`` (torch-free, shared with the daemon). A plain torchrun
  user may export the same variables by hand or pass the equivalent script arguments
  (``ElasticContext.with_overrides``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from elasticd.contract.generation import GenerationId
from elasticd.contract.settings import (
    CHANNEL_NAMES,
    DEFAULT_LR_RULE,
    FIELD_NAMES,
    IN_PLACE,
    LR_RULES,
    WorkerContractError,
    WorkerSettings,
)
from trainer.errors import ConfigError, LaunchError

log = structlog.get_logger(__name__)

__all__ = ["DEFAULT_LR_RULE", "LR_RULES", "REQUIRED_VARS", "ElasticContext"]

# env:// process-group init needs all of these; torchrun always sets them.
REQUIRED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_HOW_TO_LAUNCH = (
    "launch the script with torchrun, e.g. "
    "`python -m torch.distributed.run --standalone --nproc-per-node=2 SCRIPT ...`, "
    "or for a single process export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 "
    "MASTER_ADDR=127.0.0.1 MASTER_PORT=29500"
)


@dataclass(frozen=True, kw_only=True)
class ElasticContext(WorkerSettings):
    """This worker's place in the world plus the ``ELASTICD_*`` settings.

    The settings are inherited from ``elasticd.contract.settings.WorkerSettings`` (the
    one definition the daemon writes from); ``None`` means "not set": the library
    then uses its documented default.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    run_id: str = "none"
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # In-place re-forms of this round so far (not an environment variable: a fresh
    # worker always starts at 0; trainer.loop raises it when its group re-forms).
    generation_seq: int = 0

    def __post_init__(self) -> None:
        _check(self.world_size >= 1, "WORLD_SIZE", self.world_size, "a positive integer")
        _check(0 <= self.rank < self.world_size, "RANK", self.rank, f"0 <= RANK < {self.world_size}")
        _check(self.local_rank >= 0, "LOCAL_RANK", self.local_rank, "a non-negative integer")
        try:
            super().__post_init__()
        except WorkerContractError as exc:
            raise ConfigError(str(exc)) from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ElasticContext:
        """Read torchrun's and elasticd's variables; raise LaunchError naming what is missing."""
        env = os.environ if environ is None else environ
        missing = [name for name in REQUIRED_VARS if not env.get(name)]
        if missing:
            raise LaunchError(
                f"missing environment variable(s) {', '.join(missing)}: this is not a torchrun "
                f"worker; {_HOW_TO_LAUNCH}"
            )
        try:
            settings = WorkerSettings.from_env(env)
        except WorkerContractError as exc:
            raise ConfigError(str(exc)) from None
        world_size = _parse(env, "WORLD_SIZE", int)
        return cls(
            rank=_parse(env, "RANK", int),
            local_rank=_parse(env, "LOCAL_RANK", int),
            world_size=world_size,
            local_world_size=_parse(env, "LOCAL_WORLD_SIZE", int, default=world_size),
            node_rank=_parse(env, "GROUP_RANK", int, default=0),
            restart_count=_parse(env, "TORCHELASTIC_RESTART_COUNT", int, default=0),
            run_id=env.get("TORCHELASTIC_RUN_ID") or "none",
            master_addr=env["MASTER_ADDR"],
            master_port=_parse(env, "MASTER_PORT", int),
            **settings.as_dict(),
        )

    @classmethod
    def single_process(cls, **settings: Any) -> ElasticContext:
        """A world of one, for notebooks and unit tests (the caller owns MASTER_* setup)."""
        return cls(rank=0, local_rank=0, world_size=1, **settings)

    def with_overrides(self, **settings: Any) -> ElasticContext:
        """A copy with the given settings replaced; ``None`` values leave a setting alone.

        This is how script arguments take precedence over the environment, except for the
        daemon's channels (``CHANNEL_NAMES``: the progress and stop files): where the
        environment sets one, it stays, and a different argument is ignored with a warning.
        """
        given = {k: v for k, v in settings.items() if v is not None}
        for name in CHANNEL_NAMES:
            ours = getattr(self, name)
            if name in given and ours is not None and given[name] != ours:
                log.warning(f"--{name.replace('_', '-')} ignored: the daemon set "
                            f"ELASTICD_{name.upper()} and reads that file; drop the argument "
                            "when the script runs under elasticd", given=given.pop(name), kept=ours)
        return dataclasses.replace(self, **given)

    @property
    def settings(self) -> WorkerSettings:
        """The ``ELASTICD_*`` part alone (e.g. to hand on to a child process)."""
        return WorkerSettings(**{name: getattr(self, name) for name in FIELD_NAMES})

    @property
    def generation_id(self) -> GenerationId | None:
        """This worker's generation (elasticd.contract.generation), None without the etcd3 plugin."""
        if self.generation is None:
            return None
        return GenerationId(self.generation, self.generation_seq, self.generation_epoch)

    @property
    def in_place(self) -> bool:
        """Whether a lost peer is recovered in place: asked for, and everything it needs set."""
        return (self.recovery_mode == IN_PLACE and self.generation_file is not None
                and self.node_id is not None and self.generation is not None)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank0(self) -> bool:
        return self.local_rank == 0

    @property
    def node_first_rank(self) -> int:
        """This node's first rank: torchrun gives each agent a contiguous range, so it
        names the node in the workers' collective judgements (``trainer.fitness``)."""
        return self.rank - self.local_rank


def _parse(env: Mapping[str, str], name: str, kind: Callable[[str], Any], default: Any = None):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return kind(raw.strip())
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a valid {kind.__name__}; set it to a {kind.__name__} "
            f"or unset it"
        ) from None


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is invalid: expected {expected}")
