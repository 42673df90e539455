"""``elasticd timeline``: a job's history drawn from its lifecycle journal in etcd.

The journal (``elasticd/journal.py``) is the only source: one entry per lifecycle event
of each node, with the writer's wall-clock ``time`` and, for the loop's entries, the
``step``, ``world_size`` and rendezvous ``round`` where training stood. From it:

* per node, the intervals it was a **member** (``node-joined`` ... ``node-left``,
  ``node-failed``, ``job-completed``, or the first ``peer-lost`` about it) and
  **running** an agent (``agent-started`` ... ``agent-failed`` or the member's end);
  an entry from a node whose interval was closed (a silent node that came back) opens a
  new one;
* the **faults** (``peer-lost``: one per lost node, with every survivor that reported
  it; ``training-hang``; ``agent-failed``; ``node-failed``);
* the **recoveries** (``recovered``: the fault's kind, field ``fault``, and
  ``duration_s``, from the fault to the next completed step as the reporting daemon
  timed it; ``recovered-in-place``: the same with ``daemon_s``, drawn as "<fault> in
  place"; an entry's own ``kind`` is ``recovered``, so the fault's kind cannot be a
  field named ``kind``);
* **steps** over time (the ``step`` field of the entries), and the newest committed
  checkpoint (``checkpoint/latest``; the journal records no checkpoints).

Anyone with write access to the job's prefix can put anything there: every entry is
validated, and a malformed one is skipped with one warning naming its key.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elasticd.config import Config
from elasticd.etcd_client import EtcdClient
from elasticd.journal import recent_entries
from elasticd.rendezvous.keys import JobKeys

# More than any job writes in the journal's 7-day lifetime at a sane event rate.
DEFAULT_LIMIT = 100_000
FAULT_KINDS = ("peer-lost", "training-hang", "agent-failed", "node-failed")
_KEY_TAIL = re.compile(r"^(\d{20})-(.+)$")

Warn = Callable[[str], None]


# -- validation ---------------------------------------------------------------------------

def _number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _count(value: Any) -> bool:
    """A whole number >= 0 (a step, a world size, a round); bool is not one."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


# Fields the timeline uses, by kind: (name, check, what it must be, required).
_FIELDS: dict[str, tuple[tuple[str, Callable[[Any], bool], str, bool], ...]] = {
    "peer-lost": (("peer", _text, "a node id", True), ("how", _text, "a string", True)),
    "recovered": (("fault", _text, "a string", False),
                  ("duration_s", lambda v: _number(v) and v >= 0, "a number >= 0", True)),
    # An in-place re-form (docs/architecture.md): daemon_s runs from the loss decision to
    # the workers' report; duration_s is the workers' own re-form.
    "recovered-in-place": (("fault", _text, "a string", False),
                           ("daemon_s", lambda v: _number(v) and v >= 0, "a number >= 0", True)),
    "workers-restarted": (("cause", _text, "a string", False),),
    "node-draining": (("reason", lambda v: isinstance(v, str), "a string", False),
                      ("grace_s", _number, "a number", False)),
    "agent-failed": (("exit_code", lambda v: v is None or (isinstance(v, int) and not isinstance(
        v, bool)), "an integer or null", False),),
    "training-hang": (("stalled_s", _number, "a number", False),),
}
_COMMON = (("step", _count, "a whole number >= 0"), ("world_size", _count, "a whole number >= 0"),
           ("round", _count, "a whole number >= 0"))


@dataclass(frozen=True)
class Entry:
    key: str
    kind: str
    node: str
    time: float
    fields: dict[str, Any]

    @property
    def step(self) -> int | None:
        return self.fields.get("step")


def parse_entry(key: str, entry: dict[str, Any], prefix: str) -> Entry | str:
    """The entry if it is well formed, else what is wrong with it (one phrase)."""
    tail = key[len(prefix):] if key.startswith(prefix) else key
    match = _KEY_TAIL.match(tail)
    if match is None:
        return "key is not <20-digit time_ns>-<node>"
    kind, node, stamp = entry.get("kind"), entry.get("node"), entry.get("time")
    if not _text(kind):
        return f"kind {kind!r} is not a string"
    if not _text(node):
        return f"node {node!r} is not a string"
    if node != match.group(2):
        return f"node {node!r} is not the node in its key ({match.group(2)!r})"
    if not _number(stamp) or stamp <= 0:
        return f"time {stamp!r} is not a positive number"
    for name, check, what in _COMMON:
        if entry.get(name) is not None and not check(entry[name]):
            return f"{name} {entry[name]!r} is not {what}"
    for name, check, what, required in _FIELDS.get(kind, ()):
        if name not in entry or entry[name] is None:
            if required:
                return f"{kind} has no {name}"
            continue
        if not check(entry[name]):
            return f"{kind} {name} {entry[name]!r} is not {what}"
    fields = {k: v for k, v in entry.items() if k not in ("kind", "node", "time")}
    return Entry(key, kind, node, float(stamp), fields)


def parse_entries(raw: list[tuple[str, dict[str, Any]]], prefix: str, warn: Warn) -> list[Entry]:
    """The well-formed entries of ``recent_entries``' (key, entry) pairs, in their order;
    each malformed one is skipped and ``warn`` hears one line naming its key."""
    entries = []
    for key, entry in raw:
        parsed = parse_entry(key, entry, prefix)
        if isinstance(parsed, Entry):
            entries.append(parsed)
        else:
            warn(f"{key}: {parsed}; skipped")
    return entries


def parse_checkpoint(raw: bytes | None, key: str, warn: Warn) -> dict[str, Any] | None:
    """``checkpoint/latest`` as {step, time, node}, or None (absent or malformed: warned)."""
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict) or not _count(record.get("step")) \
            or not _number(record.get("time")):
        warn(f"{key}: not a checkpoint record with a step and a time; ignored")
        return None
    node = record.get("node")
    return {"step": record["step"], "time": float(record["time"]),
            "node": node if isinstance(node, str) else None}


# -- building -----------------------------------------------------------------------------

@dataclass
class _Interval:
    start: float
    start_kind: str
    end: float | None = None
    end_kind: str | None = None

    def close(self, t: float, kind: str) -> None:
        self.end, self.end_kind = max(t, self.start), kind


@dataclass
class _Node:
    member: list[_Interval] = field(default_factory=list)
    running: list[_Interval] = field(default_factory=list)
    lost: dict[str, Any] | None = None     # the open peer-lost fault about this node

    def is_member(self) -> bool:
        return bool(self.member) and self.member[-1].end is None

    def is_running(self) -> bool:
        return bool(self.running) and self.running[-1].end is None

    def join(self, t: float, kind: str) -> None:
        if self.is_member():
            self.leave(t, "rejoined")     # the previous life ended without a word
        self.member.append(_Interval(t, kind))
        self.lost = None

    def start_agent(self, t: float, kind: str) -> None:
        if not self.is_member():
            self.join(t, kind)
        if self.is_running():
            self.running[-1].close(t, "agent-restarted")
        self.running.append(_Interval(t, kind))

    def stop_agent(self, t: float, kind: str) -> None:
        if self.is_running():
            self.running[-1].close(t, kind)

    def leave(self, t: float, kind: str) -> None:
        self.stop_agent(t, kind)
        if self.is_member():
            self.member[-1].close(t, kind)


_ENDS = {"node-left": "left", "node-failed": "failed", "job-completed": "completed"}


def build_timeline(entries: list[Entry], job: str, *, checkpoint: dict[str, Any] | None = None,
                   as_of: float | None = None, warnings: list[str] | None = None) -> dict[str, Any]:
    """The timeline of valid journal entries, as a JSON-ready dict (times in seconds since
    the first entry, ``t``; wall-clock ``time`` where an absolute time is useful).

    ``as_of``: when the journal was read (wall clock); intervals still open end there in
    the picture (``end`` is null in the JSON). ``checkpoint``: ``parse_checkpoint``'s.
    """
    entries = sorted(entries, key=lambda e: (e.time, e.key))
    if not entries:
        raise ValueError("no journal entries")
    t0 = entries[0].time

    def rel(t: float) -> float:
        return round(t - t0, 3)

    nodes: dict[str, _Node] = {}
    faults: list[dict[str, Any]] = []
    recoveries: list[dict[str, Any]] = []
    restarts: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    completed = False
    for e in entries:
        me = nodes.setdefault(e.node, _Node())
        t = e.time
        if e.kind == "node-joined":
            me.join(t, e.kind)
        elif e.kind == "agent-started":
            me.start_agent(t, e.kind)
        elif e.kind in _ENDS:
            if not me.is_member():
                me.join(t, e.kind)
            me.leave(t, _ENDS[e.kind])
            completed |= e.kind == "job-completed"
        elif not me.is_member():
            me.join(t, e.kind)          # back after it was taken for lost (a silent node)
        if e.kind == "agent-failed":
            me.stop_agent(t, e.kind)
        if e.kind == "peer-lost":
            peer, how = e.fields["peer"], e.fields["how"]
            them = nodes.setdefault(peer, _Node())
            if them.lost is not None and them.lost["how"] == how:
                if e.node not in them.lost["reported_by"]:
                    them.lost["reported_by"].append(e.node)
            else:
                them.lost = {"kind": "peer-lost", "node": peer, "how": how, "t": rel(t),
                             "time": t, "step": e.step, "reported_by": [e.node]}
                faults.append(them.lost)
                them.leave(t, f"lost ({how})")
        elif e.kind in FAULT_KINDS:
            detail = {k: e.fields[k] for k in ("exit_code", "stalled_s", "reason") if k in e.fields}
            faults.append({"kind": e.kind, "node": e.node, "t": rel(t), "time": t, "step": e.step,
                           "reported_by": [e.node], **detail})
        if e.kind in ("recovered", "recovered-in-place"):
            took = float(e.fields["duration_s" if e.kind == "recovered" else "daemon_s"])
            kind = e.fields.get("fault", "?") + (" in place" if e.kind != "recovered" else "")
            recoveries.append({"node": e.node, "kind": kind, "duration_s": took,
                               "t": rel(t), "fault_t": rel(t - took), "time": t, "step": e.step})
        if e.kind == "workers-restarted":
            restarts.append({"node": e.node, "cause": e.fields.get("cause"), "t": rel(t),
                             "step": e.step})
        if e.step is not None:
            steps.append({"node": e.node, "t": rel(t), "step": e.step,
                          "world_size": e.fields.get("world_size"), "round": e.fields.get("round"),
                          "kind": e.kind})
    last = entries[-1].time
    end = last if completed or as_of is None else max(as_of, last)

    def intervals(items: list[_Interval]) -> list[dict[str, Any]]:
        return [{"start": rel(i.start), "end": None if i.end is None else rel(i.end),
                 "start_kind": i.start_kind, "end_kind": i.end_kind,
                 "duration_s": round((end if i.end is None else i.end) - i.start, 3)}
                for i in items]

    checkpoints = []
    if checkpoint is not None:
        checkpoints.append({"step": checkpoint["step"], "t": rel(checkpoint["time"]),
                            "time": checkpoint["time"], "node": checkpoint["node"],
                            "source": "checkpoint/latest (the newest only)"})
    return {
        "job": job, "start_time": t0, "end_time": end, "duration_s": rel(end),
        "completed": completed, "entries": len(entries),
        "nodes": {name: {"member": intervals(n.member), "running": intervals(n.running)}
                  for name, n in nodes.items()},
        "faults": faults, "recoveries": recoveries, "worker_restarts": restarts,
        "checkpoints": checkpoints, "steps": steps, "warnings": list(warnings or []),
    }


def node_ends(entries: list[Entry]) -> dict[str, tuple[str | None, str | None]]:
    """How the journal says each node's last membership ended: ``build_timeline``'s
    ``end_kind`` (``failed``, ``left``, ``completed``, ``lost (crashed)``, ...; None while
    it is open) and, for ``failed``, the reason of its last ``node-failed`` (or None)."""
    if not entries:
        return {}
    tl = build_timeline(entries, "")
    reasons = {f["node"]: f.get("reason") for f in tl["faults"] if f["kind"] == "node-failed"}
    ends = {}
    for name, node in tl["nodes"].items():
        end = node["member"][-1]["end_kind"] if node["member"] else None
        reason = reasons.get(name) if end == "failed" else None
        ends[name] = (end, reason if isinstance(reason, str) else None)
    return ends


# -- reading ------------------------------------------------------------------------------

def read_timeline(config: Config, limit: int = DEFAULT_LIMIT, warn: Warn | None = None) -> dict[str, Any]:
    """Read the job's journal and newest checkpoint from etcd; the timeline.

    ``warn`` hears one line per malformed entry (also kept in ``warnings``). Raises
    ``ValueError`` if the journal has no valid entry.
    """
    keys = JobKeys(config.job.id, config.etcd.key_prefix)
    warnings: list[str] = []

    def note(line: str) -> None:
        warnings.append(line)
        if warn is not None:
            warn(line)

    client = EtcdClient(config.etcd.settings(retry_s=3.0))
    try:
        raw = recent_entries(client, keys, limit, warn=note)
        kv = client.get(keys.checkpoint_latest)
        checkpoint = parse_checkpoint(kv.value if kv else None, keys.checkpoint_latest, note)
    finally:
        client.close()
    entries = parse_entries(raw, keys.events, note)
    if not entries:
        raise ValueError(f"the journal of job {config.job.id!r} ({keys.events}) has no valid "
                         "entry: the job never ran against this etcd, or its entries expired")
    return build_timeline(entries, config.job.id, checkpoint=checkpoint, as_of=time.time(),
                          warnings=warnings)


def format_timeline(tl: dict[str, Any]) -> str:
    """A few lines for a terminal."""
    lines = [f"job {tl['job']}: {tl['entries']} journal entries over {tl['duration_s']:.1f} s"
             f" from {_clock(tl['start_time'])}{' (completed)' if tl['completed'] else ''}"]
    for name, node in tl["nodes"].items():
        spans = ", ".join(f"{i['start']:.1f}-{'now' if i['end'] is None else format(i['end'], '.1f')}"
                          f"{'' if i['end_kind'] is None else ' ' + i['end_kind']}"
                          for i in node["member"])
        lines.append(f"  {name}: member {spans or 'never'}")
    for f in tl["faults"]:
        how = f" ({f['how']})" if "how" in f else ""
        lines.append(f"  {f['t']:7.1f} s  {f['kind']}{how} {f['node']} at step {f['step']}"
                     f" (reported by {', '.join(f['reported_by'])})")
    for r in tl["recoveries"]:
        lines.append(f"  {r['t']:7.1f} s  {r['node']} recovered from a {r['kind']} in "
                     f"{r['duration_s']:.1f} s")
    return "\n".join(lines)


def _clock(stamp: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):
        return str(stamp)


# -- drawing ------------------------------------------------------------------------------

_FAULT_STYLE = {  # kind or peer-lost how -> (marker, colour, label)
    "crashed": ("X", "#d62728", "peer lost: crashed"),
    "silent": ("X", "#e377c2", "peer lost: silent"),
    "left": ("v", "#7f7f7f", "peer left"),
    "training-hang": ("^", "#ff7f0e", "training hang"),
    "agent-failed": ("s", "#9467bd", "agent failed"),
    "node-failed": ("P", "#000000", "node failed"),
}
_OTHER_FAULT = ("X", "#8c564b", "peer lost")


def _style(fault: dict[str, Any]) -> tuple[str, str, str]:
    key = fault["how"] if fault["kind"] == "peer-lost" else fault["kind"]
    return _FAULT_STYLE.get(key, _OTHER_FAULT)


def draw_timeline(tl: dict[str, Any], png: Path) -> None:
    """One lane per node (member / running), fault markers, recovery durations; steps
    over time below; x axis in seconds since the first journal entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    names = sorted(tl["nodes"])
    end = tl["duration_s"]
    lane_h = max(1.6, 0.75 * len(names) + 0.9)
    fig, (lanes, ax_step) = plt.subplots(
        2, 1, sharex=True, figsize=(12, lane_h + 3.4),
        gridspec_kw={"height_ratios": [lane_h, 3.0]})
    y = {name: len(names) - 1 - i for i, name in enumerate(names)}   # first node on top
    for name, node in tl["nodes"].items():
        for spans, height, colour in ((node["member"], 0.7, "#c6dbef"),
                                      (node["running"], 0.34, "#2171b5")):
            bars = [(i["start"], (end if i["end"] is None else i["end"]) - i["start"])
                    for i in spans]
            lanes.broken_barh(bars, (y[name] - height / 2, height), facecolors=colour, zorder=2)
        for i in node["member"][1:]:
            late = i["start"] > 0.8 * end      # keep the label inside the axes
            lanes.text(i["start"], y[name] + 0.37, "rejoined " if late else " rejoined",
                       fontsize=8, va="bottom", ha="right" if late else "left",
                       color="#08519c", zorder=6)
    seen_styles: dict[str, tuple[str, str]] = {}
    for f in tl["faults"]:
        marker, colour, label = _style(f)
        seen_styles[label] = (marker, colour)
        for ax in (lanes, ax_step):
            ax.axvline(f["t"], color=colour, linestyle=":", linewidth=1, zorder=1)
        if f["node"] in y:
            lanes.plot([f["t"]], [y[f["node"]]], marker=marker, color=colour, markersize=11,
                       markeredgecolor="white", linestyle="none", zorder=5)
    for r in tl["recoveries"]:
        if r["node"] not in y:
            continue
        ly = y[r["node"]] - 0.43
        lanes.annotate("", xy=(r["t"], ly), xytext=(r["fault_t"], ly), zorder=4,
                       arrowprops={"arrowstyle": "|-|", "color": "#2ca02c", "linewidth": 1.5,
                                   "mutation_scale": 3})
        late = r["t"] > 0.7 * end          # keep the label inside the axes
        lanes.text(r["fault_t"] - end * 0.004 if late else r["t"] + end * 0.004, ly,
                   f"recovered in {r['duration_s']:.1f} s ({r['kind']})",
                   va="center", ha="right" if late else "left", fontsize=8, color="#1a6e1a", zorder=6,
                   bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none",
                         "alpha": 0.8})
    lanes.set_yticks([y[n] for n in names], names)
    lanes.set_ylim(-0.75, len(names) - 0.35)
    lanes.grid(axis="x", color="#eeeeee", zorder=0)
    handles = [Patch(facecolor="#c6dbef", label="member (joined)"),
               Patch(facecolor="#2171b5", label="agent running")]
    handles += [Line2D([], [], marker=m, color=c, markeredgecolor="white", markersize=9,
                       linestyle="none", label=label) for label, (m, c) in seen_styles.items()]
    if tl["recoveries"]:
        handles.append(Line2D([], [], color="#2ca02c", marker="|", label="fault → next step"))
    lanes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
                 frameon=False)

    by_node: dict[str, list[dict[str, Any]]] = {}
    for s in tl["steps"]:
        by_node.setdefault(s["node"], []).append(s)
    for name in names:
        points = by_node.get(name, [])
        if points:
            ax_step.plot([p["t"] for p in points], [p["step"] for p in points], marker="o",
                         markersize=4, linewidth=1, label=name, zorder=3)
    for c in tl["checkpoints"]:
        ax_step.plot([c["t"]], [c["step"]], marker="D", color="black", markersize=6,
                     linestyle="none", label=f"newest checkpoint (step {c['step']})", zorder=4)
    ax_step.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_step.set_ylabel("step")
    top = max([s["step"] for s in tl["steps"]] + [c["step"] for c in tl["checkpoints"]] + [1])
    ax_step.set_ylim(0, top * 1.1 + 1)                  # points at the top stay visible
    ax_step.grid(color="#eeeeee")
    if ax_step.get_legend_handles_labels()[0]:
        ax_step.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
                       title="step at each journal entry", title_fontsize=8)
    else:
        ax_step.text(0.5, 0.5, "no journal entry carries a step", transform=ax_step.transAxes,
                     ha="center", va="center", color="#777777")
    ax_step.set_xlim(0, max(end, 1.0) * 1.02)
    ax_step.set_xlabel(f"seconds since the first journal entry ({_clock(tl['start_time'])})")
    status = "completed" if tl["completed"] else f"as of {_clock(tl['end_time'])}"
    fig.suptitle(f"elasticd job {tl['job']}: {len(names)} node(s), {len(tl['faults'])} fault(s), "
                 f"{len(tl['recoveries'])} recovery(ies); {status}", fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
