"""``elasticd status``: the job's keys in etcd, read once each, as a dict or as text.

The job's state is derived from them (``derive_state``: ``/state``, the node records,
the journal), its world is the agreed in-place generation's when that is newer than
the rendezvous round's, and a job id with no key at all is ``NoSuchJob``.

Every value comes from etcd, where anything with write access to the job's prefix
can put anything. Each one is checked before use; a bad one is treated as absent
and named once in ``warnings`` (the key and what is wrong), so a malformed entry
costs one line of output, never the whole command.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

from elasticd.config import Config
from elasticd.contract.generation import GenerationId, GenerationRecord, GenerationRecordError
from elasticd.errors import ElasticdError, EtcdError
from elasticd.etcd_client import EtcdClient
from elasticd.journal import recent_entries
from elasticd.ops.timeline import DEFAULT_LIMIT, Entry, node_ends, parse_entries
from elasticd.rendezvous import admin
from elasticd.rendezvous.keys import JobKeys
from elasticd.supervisor import GONE_STATES

# Node record fields shown by status, and the types a daemon writes them with.
_NODE_FIELDS: dict[str, tuple[type, ...]] = {
    "node_id": (str,), "state": (str,), "addr": (str,),
    "agent_pid": (int, type(None)), "daemon_pid": (int, type(None)), "updated": (int, float),
    "reason": (str, type(None)),
}
# The state line names this many nodes at most.
_NAMED = 5


# `elasticd status`'s exit statuses (cli.status's help and the README say so): 0 the status
# was shown and the job is running or completed; 1 a config or etcd error (click's, as
# every command's); 2 is click's own for a bad command line, so no job state uses it.
NO_SUCH_JOB_EXIT_CODE = 4        # etcd holds no key of the job
FAILED_EXIT_CODE = 3             # every node marked failed (what `elasticd run` exits with)
STALLED_EXIT_CODE = 5            # no live node, and not every node failed
STATE_EXIT_CODES = {"failed": FAILED_EXIT_CODE, "stalled": STALLED_EXIT_CODE}
# How many job ids the no-such-job message names at most.
_JOBS_LISTED = 20


def exit_code(status: dict[str, Any]) -> int:
    """``elasticd status``'s exit status for a job it found: non-zero for a job that needs an
    operator (failed, stalled), 0 while it runs or once it completed."""
    return STATE_EXIT_CODES.get(status.get("state"), 0)


class NoSuchJob(ElasticdError):
    """etcd holds no key under the job's prefix: the job never ran against this etcd,
    or the id, the endpoints or the key prefix are not the job's.

    ``jobs``: the job ids found under the key prefix (the first ``_JOBS_LISTED``), None
    when they could not be listed; ``to_json`` is what ``status --json`` prints."""

    def __init__(self, message: str, *, job: str, prefix: str, endpoints: tuple[str, ...],
                 jobs: list[str] | None, more_jobs: bool = False) -> None:
        super().__init__(message)
        self.job, self.prefix, self.endpoints = job, prefix, endpoints
        self.jobs, self.more_jobs = jobs, more_jobs

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "state": "unknown", "error": str(self), "prefix": self.prefix,
                "endpoints": list(self.endpoints), "jobs": self.jobs,
                "jobs_truncated": self.more_jobs}


def read_status(config: Config, events: int = 10) -> dict[str, Any]:
    """The job's status from its keys (a few reads, not one snapshot: a key may change
    between two of them); ``NoSuchJob`` if there is no key under the job's prefix."""
    client = EtcdClient(config.etcd.settings(retry_s=3.0))
    keys = JobKeys(config.job.id, config.etcd.key_prefix)
    try:
        if client.count_prefix(keys.prefix) == 0:
            raise _no_such_job(client, keys, config.etcd.endpoints)
        return _read(client, keys, events)
    finally:
        client.close()


def job_ids(client: EtcdClient, root: str, most: int = _JOBS_LISTED) -> list[str]:
    """The first ``most`` job ids with a key under ``root``, in key order (one keys-only
    read of one key per job: no job's values travel)."""
    found: list[str] = []
    start, end = f"{root}/", f"{root}0"     # '0' follows '/': the range holds root/...
    while len(found) < most:
        key = client.first_key(start, end)
        if key is None:
            break
        job = key[len(root) + 1:].split("/", 1)[0]
        found.append(job)
        start = f"{root}/{job}0"             # past every key of root/job/
    return found


def _no_such_job(client: EtcdClient, keys: JobKeys, endpoints: tuple[str, ...]) -> NoSuchJob:
    where = ", ".join(endpoints)
    field = keys.root.count("/") + 2
    listing = (f"etcdctl --endpoints={where} get --prefix --keys-only {keys.root}/ "
               f"| cut -d/ -f{field} | sort -u")
    root = keys.root
    try:
        found: list[str] | None = job_ids(client, root, _JOBS_LISTED + 1)
    except EtcdError as exc:     # a job's etcd user may read its own prefix only
        found, others = None, f"The jobs under {root}/ could not be listed ({exc})."
    jobs = None if found is None else found[:_JOBS_LISTED]
    more = found is not None and len(found) > _JOBS_LISTED
    if found is not None:
        others = (f"Jobs under {root}/: {', '.join(found[:_JOBS_LISTED])}{', ...' if more else ''}."
                  if found else f"etcd holds no job under {root}/ at all.")
    message = (f"no job {keys.job_id!r} in etcd: nothing under {keys.prefix} at {where} (no node "
               f"record, no /state, no generation, no journal). Check `[job] id` in the config "
               f"(or ELASTICD_JOB_ID), `[etcd] endpoints` and `key_prefix`. "
               f"{others} List them with: {listing}")
    return NoSuchJob(message, job=keys.job_id, prefix=keys.prefix, endpoints=endpoints,
                     jobs=jobs, more_jobs=more)


class _Warnings:
    """Collects one warning per key, in the order found."""

    def __init__(self) -> None:
        self.lines: dict[str, str] = {}

    def __call__(self, key: str, problem: str) -> None:
        self.lines.setdefault(key, f"{key}: {problem}; treated as absent")

    def line(self, text: str) -> None:
        """A warning already worded by its reader (the journal's)."""
        self.lines.setdefault(text, text)


def _json_object(raw: bytes, key: str, warn: _Warnings) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:  # also bytes that are not UTF-8
        warn(key, f"not JSON ({_preview(raw)})")
        return None
    if not isinstance(value, dict):
        warn(key, f"not a JSON object ({_preview(raw)})")
        return None
    return value


def _preview(raw: bytes, chars: int = 40) -> str:
    text = repr(raw[:chars])
    return text + "..." if len(raw) > chars else text


def _is(value: Any, types: tuple[type, ...]) -> bool:
    # bool is an int subclass, but a pid or a step of `true` is as wrong as a string.
    if isinstance(value, bool) and bool not in types:
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return isinstance(value, types)


def _field(record: dict[str, Any], name: str, types: tuple[type, ...], key: str,
           warn: _Warnings) -> Any:
    value = record.get(name)
    if value is None or _is(value, types):
        return value
    warn(f"{key} {name}", f"{value!r} is a {type(value).__name__}, expected "
         f"{' or '.join(t.__name__ for t in types if t is not type(None))}")
    return None


def _guarded(what: str, key: str, warn: _Warnings, read: Callable[[], Any]) -> Any:
    """``read()``, or None and a warning if it raises anything at all.

    For reads that decode foreign data (torch's pickled rendezvous state): the
    decoder's exceptions are not ours to enumerate, and none may end the command.
    """
    try:
        return read()
    except Exception as exc:  # noqa: BLE001 - see the docstring
        warn(key, f"{what} could not be read ({type(exc).__name__}: {exc})")
        return None


def _read(client: EtcdClient, keys: JobKeys, events: int) -> dict[str, Any]:
    warn = _Warnings()
    now = time.time()
    journal = _journal(client, keys, warn)
    nodes = _nodes(client, keys, warn, now)
    state = derive_state(_recorded_state(client, keys, warn), nodes, node_ends(journal))
    rdzv = _round(client, keys, warn)
    generation = _generation(client, keys, warn, rdzv["round"], rdzv.pop("epoch"))
    return {
        "job": keys.job_id,
        "state": state["state"],
        "state_detail": state["detail"],
        "failed_nodes": state["failed_nodes"],
        "nodes": nodes,
        **rdzv,
        **_world(rdzv, generation),
        "generation": generation,
        "checkpoint": _checkpoint(client, keys, warn),
        "events": [_raw(e) for e in journal[-events:]] if events > 0 else [],
        "warnings": list(warn.lines.values()),
    }


def _recorded_state(client: EtcdClient, keys: JobKeys, warn: _Warnings) -> str | None:
    """What ``/state`` says (``completed``, its one value), or None: absent while the job runs."""
    kv = client.get(keys.state)
    record = _json_object(kv.value, keys.state, warn) if kv else None
    state = _field(record, "state", (str,), keys.state, warn) if record is not None else None
    return state or None


def derive_state(recorded: str | None, nodes: list[dict[str, Any]],
                 ends: dict[str, tuple[str | None, str | None]]) -> dict[str, Any]:
    """The job's state from what etcd holds: ``{"state", "detail", "failed_nodes"}``.

    ``recorded``: what ``/state`` says; ``nodes``: the node records (``_nodes``' rows; a
    node is live unless its record's state is one of ``supervisor.GONE_STATES``);
    ``ends``: how the journal says each node's last membership ended
    (``timeline.node_ends``). The state is ``/state``'s when it holds one; else
    ``running`` while a node is live; else ``failed`` when every node a record or the
    journal names is marked failed (by its record, or, its record gone, by the journal's
    ``node-failed``); else ``stalled``. ``failed_nodes``: node -> reason (or None).
    """
    failed = _failed_nodes(nodes, ends)
    if recorded is not None:
        return {"state": recorded, "detail": "", "failed_nodes": failed}
    live = [n["node"] for n in nodes if n["state"] not in GONE_STATES]
    known = {n["node"] for n in nodes} | set(ends)
    if live:
        state, detail = "running", _count(len(live), "live node") + (
            f"; marked failed: {_named(failed)}" if failed else "")
    elif known and set(failed) == known:
        state, detail = "failed", f"every node marked failed ({_named(failed)})"
    else:
        state, detail = "stalled", "no live node " + (
            f"({_named(_last_words(nodes, ends))})" if known
            else "(no node record, and no node in the journal)")
    return {"state": state, "detail": detail, "failed_nodes": failed}


def _failed_nodes(nodes: list[dict[str, Any]],
                  ends: dict[str, tuple[str | None, str | None]]) -> dict[str, str | None]:
    """Nodes whose record says failed, and those whose record is gone after the journal's
    ``node-failed`` (a failed daemon deletes its record as it exits): node -> reason."""
    failed = {n["node"]: n["reason"] for n in nodes if n["state"] == "failed"}
    recorded = {n["node"] for n in nodes}
    failed |= {node: reason for node, (end, reason) in ends.items()
               if end == "failed" and node not in recorded}
    return dict(sorted(failed.items()))


def _last_words(nodes: list[dict[str, Any]],
                ends: dict[str, tuple[str | None, str | None]]) -> dict[str, str | None]:
    """What is known of each node that is not live: its record's state, or the journal's end."""
    words: dict[str, str | None] = {n["node"]: f"record {n['state']}" for n in nodes}
    for node, (end, reason) in ends.items():
        if node not in words:
            words[node] = (f"{end}: {reason}" if reason else end) if end else "record gone"
    return dict(sorted(words.items()))


def _named(items: dict[str, str | None]) -> str:
    shown = [f"{node}: {_value(what)}" if what else node for node, what in list(items.items())[:_NAMED]]
    more = len(items) - _NAMED
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _nodes(client: EtcdClient, keys: JobKeys, warn: _Warnings, now: float) -> list[dict[str, Any]]:
    nodes = []
    for kv in sorted(client.get_prefix(keys.nodes), key=lambda kv: kv.key):
        record = _json_object(kv.value, kv.key, warn)
        if record is None:
            continue
        f = {name: _field(record, name, types, kv.key, warn) for name, types in _NODE_FIELDS.items()}
        ttl = _guarded("the lease", f"{kv.key} lease", warn,
                       lambda kv=kv: client.lease_ttl(kv.lease_id)) if kv.lease_id else None
        nodes.append({
            "node": f["node_id"] or kv.key.removeprefix(keys.nodes), "state": f["state"],
            "reason": f["reason"],
            "addr": f["addr"], "agent_pid": f["agent_pid"], "daemon_pid": f["daemon_pid"],
            "last_update_s_ago": None if f["updated"] is None else round(now - f["updated"], 1),
            "lease_ttl_left_s": ttl,
        })
    return nodes


def _round(client: EtcdClient, keys: JobKeys, warn: _Warnings) -> dict[str, Any]:
    absent = {"round": None, "world_nodes": 0, "rendezvous_complete": False, "waiting_nodes": 0,
              "epoch": None}
    rdzv = _guarded("the rendezvous state", keys.rdzv_state, warn,
                    lambda: admin.current_round(client, keys))
    if rdzv is None:
        return absent
    # The view's fields come out of a decoded foreign blob: check them like any value.
    view = _guarded("the rendezvous state", keys.rdzv_state, warn, lambda: {
        "round": rdzv.round, "world_nodes": rdzv.world_nodes,
        "rendezvous_complete": rdzv.complete, "waiting_nodes": rdzv.waiting})
    if view is None:
        return absent
    ok = (_is(view["round"], (int,)) and _is(view["world_nodes"], (int,))
          and isinstance(view["rendezvous_complete"], bool) and _is(view["waiting_nodes"], (int,)))
    if not ok:
        warn(keys.rdzv_state, f"the rendezvous state has unexpected fields ({view!r:.120})")
        return absent
    return {**view, "epoch": rdzv.epoch}


def _generation(client: EtcdClient, keys: JobKeys, warn: _Warnings, round_: int | None,
                epoch: str | None) -> dict[str, Any] | None:
    """The agreed in-place generation (``/generation``), and whether it is the current
    world: a later re-form of the current round (``GenerationId.newer_than``: same round,
    same epoch, seq > 0). After an in-place shrink the round's world is the old one."""
    kv = client.get(keys.generation)
    if kv is None:
        return None
    try:
        record = GenerationRecord.from_json(kv.value)
    except GenerationRecordError as exc:
        warn(keys.generation, str(exc))
        return None
    try:
        current = round_ is not None and record.id.newer_than(GenerationId(round_, 0, epoch))
    except GenerationRecordError as exc:   # an epoch no generation can carry
        warn(f"{keys.prefix}rdzv epoch", str(exc))
        current = False
    return {"generation": str(record.id), "epoch": record.id.epoch, "members": list(record.nodes),
            "world_size": record.world_size, "lost": list(record.lost), "cause": record.cause,
            "created": record.created, "current": current}


def _world(rdzv: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """The current world: the agreed generation's when it is newer than the round's."""
    round_world = {"round_world_nodes": rdzv["world_nodes"]}
    if generation is None or not generation["current"]:
        return {**round_world, "world_nodes": rdzv["world_nodes"], "world_members": None,
                "world_source": None if rdzv["round"] is None else f"round {rdzv['round']}"}
    return {**round_world, "world_nodes": len(generation["members"]),
            "world_members": generation["members"],
            "world_source": f"generation {generation['generation']}"}


def _checkpoint(client: EtcdClient, keys: JobKeys, warn: _Warnings) -> dict[str, Any] | None:
    kv = client.get(keys.checkpoint_latest)
    record = _json_object(kv.value, keys.checkpoint_latest, warn) if kv else None
    if record is None:
        return None
    step = record.get("step")
    if not _is(step, (int,)) or step < 0:
        warn(keys.checkpoint_latest, f"step {step!r} is not a whole number >= 0")
        return None
    node = _field(record, "node", (str,), keys.checkpoint_latest, warn)
    return {**record, "step": step, "node": node or "?"}


def _journal(client: EtcdClient, keys: JobKeys, warn: _Warnings) -> list[Entry]:
    """Every well-formed journal entry, oldest first (validated as ``elasticd timeline``
    validates them; a malformed one is one warning, and skipped)."""
    return parse_entries(recent_entries(client, keys, DEFAULT_LIMIT, warn=warn.line),
                         keys.events, warn.line)


def _raw(entry: Entry) -> dict[str, Any]:
    """The entry as its writer put it (``--json``)."""
    return {"kind": entry.kind, "node": entry.node, "time": entry.time, **entry.fields}


def _clock(stamp: float) -> str:
    try:
        return time.strftime("%H:%M:%S", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):  # a valid float far beyond any real date
        return "??:??:??"


def format_status(status: dict[str, Any]) -> str:
    """``read_status``'s dict as text: the state line, the world, the newest checkpoint,
    one line per node, per recent event and per warning."""
    ckpt = status["checkpoint"]
    detail = status.get("state_detail")
    lines = [
        f"job {status['job']}: {status['state']}{': ' + detail if detail else ''}",
        _world_line(status),
        f"newest checkpoint: step {ckpt['step']} (by {ckpt['node']})" if ckpt else "newest checkpoint: none",
        "nodes:",
    ]
    for n in status["nodes"]:
        # str(): a field treated as absent is None, which format specs refuse.
        lines.append(f"  {n['node']!s:<16} {n['state']!s:<10} addr {n['addr']}, agent pid {n['agent_pid']}, "
                     f"lease {n['lease_ttl_left_s']} s left, updated {n['last_update_s_ago']} s ago"
                     + (f", reason: {_value(n['reason'])}" if n.get("reason") else ""))
    lines.append("recent events:")
    for e in status["events"]:
        lines.append(f"  {_clock(e['time'])} {e['node']:<16} {describe_event(e)}")
    for warning in status.get("warnings", []):
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _world_line(status: dict[str, Any]) -> str:
    line = f"rendezvous round {status['round']}, {status['world_nodes']} node(s) in the world"
    gen = status.get("generation")
    if status.get("world_members") is not None and gen is not None:
        lost = f"; lost {_listed(gen['lost'])}" if gen["lost"] else ""
        line += (f" (generation {gen['generation']}, in place: {_listed(gen['members'])}{lost}; "
                 f"the round formed with {status['round_world_nodes']})")
    elif not status["rendezvous_complete"]:
        line += " (forming)"
    return f"{line}, {status['waiting_nodes']} waiting"


def _listed(names: list[str], most: int = 8) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


# An event's fields: who it is about, why it happened, and where training stood.
_ABOUT = "peer"
_WHY = ("reason", "cause", "how", "fault")
_WHERE = {"step": "step", "world_size": "world size", "round": "round"}


def describe_event(event: dict[str, Any]) -> str:
    """One journal entry as a line: what happened (to whom), why, its other fields, and
    where training stood, e.g. ``peer-lost b: crashed (step 40, world size 3, round 2)``."""
    what = event["kind"] + (f" {_value(event[_ABOUT])}" if event.get(_ABOUT) else "")
    why = next((k for k in _WHY if event.get(k) not in (None, "")), None)
    shown = {"kind", "node", "time", _ABOUT, why, *_WHERE}
    rest = [f"{k} {_value(v)}" for k, v in event.items() if k not in shown and v not in (None, "", [])]
    where = [f"{label} {_value(event[k])}" for k, label in _WHERE.items() if event.get(k) is not None]
    line = what + (f": {_value(event[why])}" if why else "") + (f"; {', '.join(rest)}" if rest else "")
    return line + (f" ({', '.join(where)})" if where else "")


def _value(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(_value(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, default=str)
    return " ".join(str(value).split())     # one line, whatever the writer put in it
