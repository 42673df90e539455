"""A chaos scenario: a seed and a sequence of faults with their timing and target.

Written as a small TOML or JSON file::

    seed = 7                 # recorded; also picks "any" targets
    nodes = 3
    etcd_members = 3         # 1 or 3; default 3 if a fault needs it (etcd-leader-kill ...)
    final_step = 1500        # the job's --max-steps
    [[fault]]
    kind = "node-kill"       # a name of elasticd.lab.chaos.faults.INJECTORS
    at_step = 100            # or at_s = 20.0: seconds after the first world of `nodes`
    target = "rank0"         # "rank0" | "other" | "any" | a node name ("a", "b", ...)

or drawn from a seed (``draw``). A fault fires at its step or time, or as soon as the
previous one has recovered if that moment has already passed (so a fault never lands
inside another's recovery unless it is written to: the runner records where it fired).

A fault written to overlap the one before it names a phase of that fault's recovery
instead of a moment::

    [[fault]]
    kind = "node-stop"
    during = "restart"       # a phase of PHASES: fire once the previous fault reached it
    gap_s = 0.8              # ... and this long after (0-30 s; default 0)

A fault that lasts (a freeze, a cut: its injector says ``lasts``) may say how long
(``for_s = 40``: longer than the hang bound, say); ``[supervisor]`` settings for every
daemon go in a table of their own (``[supervisor] hang_timeout_s = 15``), to shorten a
bound or weaken the system on purpose.

It fires ``gap_s`` after the phase's first log line following the previous fault's
injection (``inject``: after the injection itself), while that fault is still healing and
recovering; the faults chained this way recover as one (``draw(..., overlap=True)``
draws such pairs, the runner records the phase each one fired in).
"""

from __future__ import annotations

import json
import random
import string
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from elasticd.rendezvous.keys import DEFAULT_ROUNDS, ROUNDS

TARGETS = ("rank0", "other", "any")
MAX_NODES = 8
MAX_GAP_S = 30.0
# The [supervisor] keys the harness writes itself (elasticd.lab.local_cluster.write_config).
HARNESS_SUPERVISOR = frozenset({"backoff_initial_s", "drain_grace_s"})

# The phases of a recovery an overlapping fault can fire in: name -> the daemon log line
# (any node's, a substring of its event) that says the phase began. The runner watches for
# them; one definition for the scenario's validation, the draw and the runner.
PHASES: dict[str, str | None] = {
    "inject": None,                                      # the previous injection itself
    "drain": "draining because",                         # a drain's coordinated stop began
    "restart": "restarting the local workers",           # workers stopped for the next round
    "round": "the agent restarted its workers",          # a round closed: group init, resume
    "reform": "re-forming the world in place",           # survivors re-form without a peer
    "join": "starting the torchrun agent",               # a (re)started node joins
}


class ScenarioError(ValueError):
    """A scenario that cannot run; the message names the field and what is allowed."""


@dataclass(frozen=True)
class FaultSpec:
    """One planned fault: exactly one of ``at_step`` / ``at_s`` / ``during`` is set
    (``during``: a phase of the previous fault's recovery, ``gap_s`` after it)."""

    kind: str
    target: str = "any"
    at_step: int | None = None
    at_s: float | None = None
    during: str | None = None
    gap_s: float | None = None
    for_s: float | None = None     # how long a fault that lasts lasts (None: its default)

    def when(self) -> str:
        if self.during is not None:
            return f"{self.gap_s or 0:g} s into the previous fault's {self.during}"
        return f"step {self.at_step}" if self.at_step is not None else f"{self.at_s:g} s"


@dataclass(frozen=True)
class Scenario:
    seed: int
    faults: tuple[FaultSpec, ...]
    nodes: int = 3
    final_step: int = 1500
    every_steps: int = 20          # the job's checkpoint interval
    # Per step: the sleep dominates a step, so that the step rate (and the steps a fault's
    # recovery takes) does not swing with the machine's load.
    step_sleep: float = 0.1
    etcd_members: int = 1          # 1, or 3 (EmbeddedEtcdCluster) for leader and quorum faults
    name: str = field(default="")
    rounds: str = DEFAULT_ROUNDS   # [rendezvous] rounds of the daemons: keyed | torch
    # [supervisor] settings of every daemon (validated as the daemon's config would be)
    supervisor: dict[str, Any] = field(default_factory=dict)

    def node_names(self) -> list[str]:
        return list(string.ascii_lowercase[: self.nodes])

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["faults"] = [{k: v for k, v in asdict(f).items() if v is not None} for f in self.faults]
        return out


def _members_needed(kind: str) -> int:
    from elasticd.lab.chaos.faults import INJECTORS

    cls = INJECTORS.get(kind)
    return cls.etcd_members if cls is not None else 1


def _needs(kind: str, what: str) -> bool:
    from elasticd.lab.chaos.faults import INJECTORS

    cls = INJECTORS.get(kind)
    return bool(cls is not None and getattr(cls, what))


def _kinds() -> Sequence[str]:
    from elasticd.lab.chaos.faults import INJECTORS  # late: faults imports the runner's types

    return tuple(INJECTORS)


def _int(raw: dict[str, Any], key: str, default: int, low: int, high: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ScenarioError(f"{key} = {value!r}: must be a whole number {bound}")
    return value


def _fault(raw: Any, index: int, nodes: int, kinds: Sequence[str]) -> FaultSpec:
    where = f"fault #{index + 1}"
    if not isinstance(raw, dict):
        raise ScenarioError(f"{where}: a table with kind, target and at_step or at_s, not {raw!r}")
    unknown = set(raw) - {"kind", "target", "at_step", "at_s", "during", "gap_s", "for_s"}
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {sorted(unknown)}; use kind, target, at_step, "
                            "at_s, during, gap_s, for_s")
    kind = raw.get("kind")
    if kind not in kinds:
        raise ScenarioError(f"{where}: kind {kind!r} is not one of {', '.join(kinds)}")
    target = raw.get("target", "any")
    names = string.ascii_lowercase[:nodes]
    if not isinstance(target, str) or (target not in TARGETS and target not in names):
        raise ScenarioError(f"{where}: target {target!r}: use {', '.join(TARGETS)} or a node "
                            f"name of this scenario ({', '.join(names)})")
    at_step, at_s, during = raw.get("at_step"), raw.get("at_s"), raw.get("during")
    if sum(v is not None for v in (at_step, at_s, during)) != 1:
        raise ScenarioError(f"{where}: give exactly one of at_step (a step), at_s (seconds) or "
                            "during (a phase of the previous fault's recovery)")
    for_s = _duration(raw, where, kind)
    if during is not None:
        return replace(_overlapping(raw, where, index, kind, target), for_s=for_s)
    if "gap_s" in raw:
        raise ScenarioError(f"{where}: gap_s goes with during (a phase); at a step or time, "
                            "leave it out")
    if at_step is not None and (not isinstance(at_step, int) or isinstance(at_step, bool) or at_step < 1):
        raise ScenarioError(f"{where}: at_step = {at_step!r}: a step >= 1")
    if at_s is not None and (not isinstance(at_s, (int, float)) or isinstance(at_s, bool) or at_s < 0):
        raise ScenarioError(f"{where}: at_s = {at_s!r}: seconds >= 0")
    return FaultSpec(kind, target, at_step, None if at_s is None else float(at_s), for_s=for_s)


def _duration(raw: dict[str, Any], where: str, kind: str) -> float | None:
    """``for_s``: only for a fault that lasts, seconds in 1..600."""
    if "for_s" not in raw:
        return None
    value = raw["for_s"]
    if not _lasts(kind):
        raise ScenarioError(f"{where}: {kind} does not last, so for_s has no meaning; leave it "
                            "out (faults that last: a node-stop, the network faults)")
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 1 <= value <= 600:
        raise ScenarioError(f"{where}: for_s = {value!r}: seconds in 1..600")
    return float(value)


def _lasts(kind: str) -> bool:
    from elasticd.lab.chaos.faults import INJECTORS

    return bool(INJECTORS[kind].lasts)


def _supervisor(raw: Any) -> dict[str, Any]:
    """``[supervisor]`` settings for every daemon, checked as the daemon checks its config."""
    from elasticd.config import SupervisorConfig
    from elasticd.errors import ConfigError

    if not isinstance(raw, dict):
        raise ScenarioError(f"supervisor = {raw!r}: a table of [supervisor] settings")
    known = {f.name for f in fields(SupervisorConfig)}
    fixed = sorted(set(raw) & HARNESS_SUPERVISOR)
    if fixed:
        raise ScenarioError(f"supervisor: {fixed} are set by the harness (local_cluster) for every "
                            "run; leave them out")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ScenarioError(f"supervisor: unknown key(s) {unknown}; the daemon's [supervisor] "
                            f"has {', '.join(sorted(known))}")
    try:
        SupervisorConfig(**raw)
    except (ConfigError, TypeError) as exc:
        raise ScenarioError(f"supervisor: {exc}") from None
    return dict(raw)


def _overlapping(raw: dict[str, Any], where: str, index: int, kind: str, target: str) -> FaultSpec:
    """A fault that fires in a phase of the previous one's recovery (``during``)."""
    during, gap = raw["during"], raw.get("gap_s", 0.0)
    if index == 0:
        raise ScenarioError(f"{where}: during names a phase of the previous fault's recovery; "
                            "the first fault has none: give it at_step or at_s")
    if during not in PHASES:
        raise ScenarioError(f"{where}: during = {during!r} is not one of {', '.join(PHASES)}")
    if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not 0 <= gap <= MAX_GAP_S:
        raise ScenarioError(f"{where}: gap_s = {gap!r}: seconds in 0..{MAX_GAP_S:g} after the phase")
    return FaultSpec(kind, target, during=during, gap_s=float(gap))


def from_dict(raw: dict[str, Any], kinds: Sequence[str] | None = None, name: str = "") -> Scenario:
    """Validate a parsed scenario file; ``ScenarioError`` says what is wrong and where."""
    kinds = kinds or _kinds()
    unknown = set(raw) - {"seed", "nodes", "final_step", "every_steps", "step_sleep",
                          "etcd_members", "fault", "faults", "name", "rounds", "supervisor"}
    if unknown:
        raise ScenarioError(f"unknown key(s) {sorted(unknown)}")
    seed = _int(raw, "seed", 0, 0)
    nodes = _int(raw, "nodes", 3, 2, MAX_NODES)
    final_step = _int(raw, "final_step", 1500, 10)
    every = _int(raw, "every_steps", 20, 1)
    sleep = raw.get("step_sleep", 0.1)
    if not isinstance(sleep, (int, float)) or isinstance(sleep, bool) or not 0 <= sleep <= 5:
        raise ScenarioError(f"step_sleep = {sleep!r}: seconds in 0..5")
    rounds = raw.get("rounds", DEFAULT_ROUNDS)
    if rounds not in ROUNDS:
        raise ScenarioError(f"rounds = {rounds!r}: one of {', '.join(ROUNDS)} (the daemons' "
                            "[rendezvous] rounds)")
    items = raw.get("fault", raw.get("faults", []))
    if not isinstance(items, list) or not items:
        raise ScenarioError("no faults: give at least one [[fault]] table")
    faults = tuple(_fault(f, i, nodes, kinds) for i, f in enumerate(items))
    # A leader or quorum fault needs three members: the default then, and nothing less.
    needed = max(_members_needed(f.kind) for f in faults)
    members = _int(raw, "etcd_members", needed, 1, 3)
    if members not in (1, 3):
        raise ScenarioError(f"etcd_members = {members}: 1 or 3 (an even count tolerates no more "
                            "failures than the odd one below it)")
    if members < needed:
        kind = next(f.kind for f in faults if _members_needed(f.kind) > members)
        raise ScenarioError(f"etcd_members = {members}: {kind} needs a {needed}-member etcd cluster")
    network = [f.kind for f in faults if _needs(f.kind, "network")]
    loopback = [f.kind for f in faults if _needs(f.kind, "needs_metadata")] + (
        [f"etcd_members = {members}"] if members != 1 else [])
    if network and loopback:
        raise ScenarioError(f"{network[0]} runs the cluster on a network of its own, with one etcd "
                            f"member and no fake metadata server; {loopback[0]} needs loopback: put "
                            "the network faults in a scenario of their own")
    late = [(i, f) for i, f in enumerate(faults) if f.at_step is not None and f.at_step >= final_step]
    if late:
        i, f = late[0]
        raise ScenarioError(f"fault #{i + 1}: {f.kind} at step {f.at_step} is not before "
                            f"final_step {final_step}: it would never fire")
    return Scenario(seed, faults, nodes, final_step, every, float(sleep), members,
                    str(raw.get("name", name)), rounds, _supervisor(raw.get("supervisor", {})))


def load(path: Path, kinds: Sequence[str] | None = None) -> Scenario:
    """A scenario file: ``.toml`` or ``.json``."""
    text = path.read_text()
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if path.suffix == ".json" else "TOML"
        raise ScenarioError(f"{path}: not valid {kind}: {exc}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: a table of settings, not {type(raw).__name__}")
    try:
        return from_dict(raw, kinds, name=path.stem)
    except ScenarioError as exc:
        raise ScenarioError(f"{path}: {exc}") from None


# The steps the job is given per drawn fault. A fault fires once the previous one has
# recovered, and the job steps on meanwhile (a hold, a drain's grace, a node's return):
# 15 faults took ~2,300 steps at 0.1 s a step (seed 21, chaos-keyed), so a budget of
# ``spacing`` (60) per fault ended the job with faults left unfired.
FAULT_STEPS = 300


def draw(seed: int, kinds: Iterable[str], nodes: int = 3, first_step: int = 60,
         spacing: int = 60, tail: int = 150, overlap: bool = False, **settings: Any) -> Scenario:
    """A scenario from a seed: ``kinds`` in a seeded order, each at a seeded target, one
    every ``spacing`` steps from ``first_step``; the job runs ``FAULT_STEPS`` per fault
    (or ``spacing``, if larger) and ``tail`` more, unless ``final_step`` is given (per
    burst, with ``overlap``).

    ``overlap``: the faults come in pairs, the second of each fired in a seeded phase of
    the first one's recovery (one its injector says it goes through) 0-2 s after that
    phase began.

    The same seed and set of kinds give the same scenario (``random.Random(seed)``).
    """
    kinds = sorted(kinds)   # the order they are given in does not change the draw
    known = _kinds()
    bad = [k for k in kinds if k not in known]
    if bad:
        raise ScenarioError(f"unknown fault kind(s) {bad}; known: {', '.join(known)}")
    if not kinds:
        raise ScenarioError("no fault kinds to draw from")
    rng = random.Random(seed)
    rng.shuffle(kinds)
    targets = [*TARGETS[:2], *string.ascii_lowercase[:nodes]]
    faults = [{"kind": k, "target": rng.choice(targets), "at_step": first_step + i * spacing}
              for i, k in enumerate(kinds)]
    if overlap:
        for first, second in zip(faults[::2], faults[1::2], strict=False):
            del second["at_step"]
            second["during"] = rng.choice(_phases_of(first["kind"]))
            second["gap_s"] = round(rng.uniform(0.0, 2.0), 2)
    # FAULT_STEPS per burst: a pair fires at once and recovers as one.
    bursts = sum(1 for f in faults if "during" not in f)
    final = first_step + bursts * max(spacing, FAULT_STEPS) + tail
    return from_dict({"seed": seed, "nodes": nodes, "final_step": final, "faults": faults,
                      **settings}, known, name=f"seed-{seed}{'-overlap' if overlap else ''}")


def _phases_of(kind: str) -> tuple[str, ...]:
    from elasticd.lab.chaos.faults import INJECTORS

    return INJECTORS[kind].phases
