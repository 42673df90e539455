"""The worker contract: every ``ELASTICD_*`` setting the daemon hands to its workers.

One definition, used on both sides:

* the daemon writes it (``elasticd.agent.worker_env`` -> ``WorkerSettings.to_env``);
* the worker reads it (``trainer.context.ElasticContext`` -> ``WorkerSettings.from_env``);
* the example scripts derive their override flags from it (``FIELDS``).

A plain torchrun user may export the same variables by hand. Every setting is
optional; ``None`` means "not set" and the trainer then uses its documented default.

Adding a setting is one line in ``WorkerSettings``: its variable name is
``ELASTICD_`` + the upper-cased field name, its flag ``--`` + the field name with
dashes, and its parser, check and help text sit in its ``setting(...)`` call.

This module must stay importable without torch and without ``trainer`` (a test checks
that in a fresh interpreter): ``elasticd.config`` imports it, and loading a config costs
no torch import (``elasticd drain``, ``timeline``). The daemon process itself does
import torch (its rendezvous modules, the recovery store).
It also defines the etcd credential hand-over to the agent (stdin, never the
environment: torchrun's workers inherit the agent's environment).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import IO, Any

PREFIX = "ELASTICD_"

LR_RULES = ("linear", "sqrt", "none")
# The one default LR rule, for the daemon's [lr] rule and for a worker whose
# ELASTICD_LR_RULE is unset: the learning rate scales with the world size
# (Goyal et al.), so a script tuned on N workers keeps its per-sample step size
# when the world grows or shrinks. It used to be "none" in the trainer and
# "linear" in the daemon, so the same script trained differently under each.
DEFAULT_LR_RULE = "linear"

# Checkpoints kept: at least two, so a crash during a save always leaves an
# older committed checkpoint. Used by the daemon config, the trainer and the
# checkpoint manager.
MIN_KEEP_LAST = 2
DEFAULT_KEEP_LAST = 3
KEEP_LAST_WHY = "so a crash during a save always leaves a valid older checkpoint"
KEEP_LAST_RULE = f"keep at least {MIN_KEEP_LAST} checkpoints, {KEEP_LAST_WHY}"

class RecoveryMode(StrEnum):
    """What the survivors of a lost peer do.

    ``IN_PLACE``: they keep their processes and re-form the group (needs a generation
    file: the daemon's, or the etcd3 plugin's recovery companion's with ``--rdzv-conf
    recovery=in-place``); ``RESTART``: they exit and torchrun starts new ones. A
    ``StrEnum``: it is its string in TOML, ``--rdzv-conf`` and the environment.
    """

    IN_PLACE = "in-place"
    RESTART = "restart"


IN_PLACE, RESTART = RecoveryMode.IN_PLACE, RecoveryMode.RESTART
RECOVERY_MODES = tuple(mode.value for mode in RecoveryMode)
# The one default, wherever something agrees the next generation (the daemon's
# ``[recovery] mode``, its policy): in place.
DEFAULT_RECOVERY = RecoveryMode.IN_PLACE
# Not a default but the only mode possible where nothing agrees generations: a worker
# nobody told of a daemon or a companion, plain torchrun without ``recovery=in-place``
# (the plugin's companion is opt-in: it runs inside torchrun's agent).
UNAGREED_RECOVERY = RecoveryMode.RESTART
DEFAULT_RECOVERY_BOUND_S = 5.0
# How an in-place re-form rebuilds the group. "auto": torch's reconfigure API where the
# installed torch and the backend have it (gloo on 2.14+, nccl2), chosen by capability at
# run time, else "destroy-init" (leave the old group, init a new one; torch 2.13, NCCL's
# legacy backend, a group the script created itself). "destroy-init" forces the fallback.
REFORM_MECHANISMS = ("auto", "destroy-init")

# etcd credentials reach the agent on its stdin, never in its environment.
ETCD_AUTH_STDIN_VAR = "ELASTICD_ETCD_AUTH_STDIN"
# Variables that must never reach an agent (the daemon's own env may hold them:
# elasticd.config reads them as overrides).
SECRET_VARS = ("ELASTICD_ETCD_USER", "ELASTICD_ETCD_PASSWORD")


class WorkerContractError(ValueError):
    """A setting is invalid; the message names its variable, the value and the fix."""


def is_valid_keep_last(value: object) -> bool:
    """The keep_last rule: a whole number >= MIN_KEEP_LAST (bool is not a number here)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= MIN_KEEP_LAST


def _positive_int(value: Any) -> bool:
    return value >= 1


def _flag(value: Any) -> bool:
    return value in (0, 1)


def _non_negative(value: Any) -> bool:
    return value >= 0


def _positive_finite(value: Any) -> bool:
    return value > 0 and math.isfinite(value)


def _env_text(value: Any) -> bool:
    # A blank string in the environment means "unset", so as a value it would silently
    # become "unset" after a round trip; and an environment cannot carry NUL.
    return value.strip() != "" and "\x00" not in value


def setting(kind: type, help: str, *, default: Any = None,
            check: Callable[[Any], bool] | None = None, expected: str = "",
            choices: tuple[str, ...] = (), channel: bool = False) -> Any:
    """Declare one contract field (a dataclass field whose metadata says how to parse it).

    ``channel``: a file the daemon (or the plugin) itself reads or writes to talk to the
    workers: where its environment sets one, a script argument must not move it."""
    if kind is str and check is None:
        check, expected = _env_text, expected or "a non-blank string without NUL"
    return dataclasses.field(default=default, metadata={
        "kind": kind, "help": help, "check": check, "expected": expected, "choices": choices,
        "channel": channel,
    })


@dataclass(frozen=True)
class WorkerSettings:
    """The ``ELASTICD_*`` settings of a worker. ``None``: not set (the trainer's default)."""

    job_id: str | None = setting(str, "job label")
    node_id: str | None = setting(str, "node label")
    checkpoint_dir: str | None = setting(str, "shared checkpoint directory (rank 0 writes)")
    checkpoint_every_steps: int | None = setting(
        int, "periodic save every N steps", check=_positive_int, expected="an integer >= 1")
    checkpoint_every_s: float | None = setting(
        float, "periodic save every S seconds", check=_positive_finite, expected="a number > 0")
    keep_last: int = setting(int, "committed checkpoints kept", default=DEFAULT_KEEP_LAST,
                             check=is_valid_keep_last, expected=f"an integer >= {MIN_KEEP_LAST}")
    lr_rule: str = setting(str, "LR rescale to the world size", default=DEFAULT_LR_RULE,
                           choices=LR_RULES)
    lr_base_world_size: int | None = setting(
        int, "world size the configured LR is for (default: the first world's)",
        check=_positive_int, expected="a positive integer")
    lr_warmup_steps: int = setting(int, "LR ramp length after a world-size change", default=0,
                                   check=_non_negative, expected="an integer >= 0")
    stop_file: str | None = setting(str, "exists -> coordinated stop, as SIGTERM", channel=True)
    leave_file: str | None = setting(
        str, "exists -> this node's torchrun agent joins no further round and leaves the "
        "rendezvous (a drain in place: its workers stop, the others go on)", channel=True)
    enter_file: str | None = setting(
        str, "exists (the live world's round and epoch) -> this node's next torchrun round is "
        "its agent's alone and its workers start as newcomers (a join in place; read once)",
        channel=True)
    progress_file: str | None = setting(
        str, "JSON progress record, rewritten after every event (steps: at most every 0.25 s)",
        channel=True)
    daemon_pid: int | None = setting(int, "exit when this process dies",
                                     check=_positive_int, expected="a positive pid")
    generation: int | None = setting(
        int, "rendezvous round of this world (set by the etcd3 plugin; fences checkpoint commits)",
        check=_non_negative, expected="an integer >= 0")
    generation_epoch: str | None = setting(
        str, "id of the rendezvous state's lifetime the generation counts in (set by the plugin)")
    recovery_mode: str = setting(
        str, "after a lost peer: re-form the group in place, or exit for a torchrun restart",
        default=UNAGREED_RECOVERY, choices=RECOVERY_MODES)
    recovery_bound_s: float = setting(
        float, "longest an in-place re-form may take before the worker exits (the restart path)",
        default=DEFAULT_RECOVERY_BOUND_S, check=_positive_finite, expected="a number > 0")
    generation_file: str | None = setting(
        str, "the generation record for these workers (in-place re-forms; the daemon's, or the "
        "etcd3 plugin's with recovery=in-place)")
    secret_file: str | None = setting(
        str, "the job's secret (the same file on every node, mode 600): every member of an "
        "in-place group proves it knows it before any state is taken from it "
        "(elasticd.contract.secret); unset: groups form unauthenticated")
    joining: int = setting(
        int, "1: this worker enters a live group in place (a newcomer: the generation file's "
        "next record names its node among the joined; no checkpoint is read, the newest state "
        "comes from a live peer)", default=0, check=_flag, expected="0 or 1")
    reform: str = setting(
        str, "how an in-place re-form rebuilds the group: auto (torch's reconfigure where the "
        "backend has it, else destroy + init) or destroy-init", default="auto",
        choices=REFORM_MECHANISMS)
    nonfinite_loss_limit: int = setting(
        int, "agreed non-finite losses in a row after which the workers exit as diverged (0: never)",
        default=3, check=_non_negative, expected="an integer >= 0")

    def __post_init__(self) -> None:
        for f in FIELDS:
            value = getattr(self, f.name)
            _validate(f, value)
            if f.metadata["kind"] is float and isinstance(value, int):
                # TOML and callers give whole seconds as int; store one type.
                object.__setattr__(self, f.name, float(value))

    def to_env(self) -> dict[str, str]:
        """The variables to export; unset (None) settings are left out."""
        return {env_name(f): _format(getattr(self, f.name)) for f in FIELDS
                if getattr(self, f.name) is not None}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        """Parse the ``ELASTICD_*`` variables of ``env``; unset or empty ones keep the default."""
        values = {}
        for f in FIELDS:
            raw = env.get(env_name(f))
            if raw is not None and raw.strip() != "":
                values[f.name] = parse(f, raw)
        return cls(**values)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in FIELDS}


FIELDS: tuple[dataclasses.Field, ...] = dataclasses.fields(WorkerSettings)
FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS)
# The files the daemon reads (progress) or writes (stop) in the workers' run: an override
# of them would cut the daemon off (measured: in-place recovery fell back to a restart,
# 19.2 s instead of 0.23 s, and `elasticd status` showed no steps).
CHANNEL_NAMES: tuple[str, ...] = tuple(f.name for f in FIELDS if f.metadata["channel"])


def env_name(f: dataclasses.Field) -> str:
    return PREFIX + f.name.upper()


# Read by the etcd3 plugin inside torchrun's agent (the agent's environment is the workers').
LEAVE_FILE_ENV = PREFIX + "LEAVE_FILE"
ENTER_FILE_ENV = PREFIX + "ENTER_FILE"
# Set by the keyed handler in its agent's environment for a newcomer's own world.
JOINING_ENV = PREFIX + "JOINING"


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def contract_env_names() -> tuple[str, ...]:
    return tuple(env_name(f) for f in FIELDS)


def parse(f: dataclasses.Field, raw: str) -> Any:
    """One variable's text -> its value, or WorkerContractError naming the variable."""
    kind = f.metadata["kind"]
    # Numbers and choices tolerate surrounding blanks and case ("SQRT"); free text (paths,
    # labels) is taken as written, so that to_env -> from_env gives back the same value.
    text = raw if kind is str and not f.metadata["choices"] else raw.strip()
    if f.metadata["choices"]:
        text = text.lower()
    try:
        value = _parse_bool(text) if kind is bool else kind(text)
    except ValueError:
        raise WorkerContractError(
            f"{env_name(f)}={raw!r} is not a valid {kind.__name__}: set {env_name(f)} "
            f"(or {flag_name(f)}) to {_expected(f)}, or unset it"
        ) from None
    _validate(f, value)
    return value


_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


def _parse_bool(text: str) -> bool:
    # bool("0") is True: a flag needs its own parser.
    try:
        return _BOOLS[text.lower()]
    except KeyError:
        raise ValueError(text) from None


def _validate(f: dataclasses.Field, value: Any) -> None:
    if value is None:
        return
    kind, check, choices = f.metadata["kind"], f.metadata["check"], f.metadata["choices"]
    ok = (isinstance(value, kind) or (kind is float and isinstance(value, int))) \
        and not (isinstance(value, bool) and kind is not bool)
    ok = ok and (not choices or value in choices) and (check is None or check(value))
    if not ok:
        raise WorkerContractError(
            f"{env_name(f)}={value!r} is invalid: expected {_expected(f)}; set {env_name(f)} "
            f"(or {flag_name(f)}) accordingly, or unset it for the default"
        )


def _expected(f: dataclasses.Field) -> str:
    if f.metadata["choices"]:
        return " | ".join(f.metadata["choices"])
    return f.metadata["expected"] or f"a {f.metadata['kind'].__name__}"


def _format(value: Any) -> str:
    # repr round-trips a float exactly (str does too on CPython 3, repr says so).
    if isinstance(value, bool):
        return "1" if value else "0"
    return repr(value) if isinstance(value, float) else str(value)


# ---- etcd credentials on the agent's stdin -------------------------------------------------

def encode_etcd_auth(user: str, password: str) -> bytes:
    """The one line the daemon writes to the agent's stdin: ``{"user": .., "password": ..}\\n``.

    JSON escapes any newline in the values, so the record is always exactly one line.
    """
    return json.dumps({"user": user, "password": password}).encode() + b"\n"


def decode_etcd_auth(stream: IO[bytes] | IO[str]) -> tuple[str, str]:
    """Read the credential line from ``stream`` (the agent's stdin): ``(user, password)``."""
    line = stream.readline()
    try:
        record = json.loads(line)
        user, password = record["user"], record["password"]
    except (ValueError, TypeError, KeyError) as exc:
        raise WorkerContractError(
            f"{ETCD_AUTH_STDIN_VAR}=1 but stdin does not carry a credential line "
            f'({{"user": ..., "password": ...}}): {exc!r}; start the agent through elasticd, '
            f"or unset {ETCD_AUTH_STDIN_VAR} and pass user=/password= in --rdzv-conf"
        ) from None
    if not (isinstance(user, str) and isinstance(password, str)):
        raise WorkerContractError("the etcd credential line must hold strings for user and password")
    return user, password
