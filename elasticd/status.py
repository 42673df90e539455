"""``elasticd status``: one read of the job's keys in etcd, as a dict or as text."""

from __future__ import annotations

import json
import time
from typing import Any

from elasticd.config import Config
from elasticd.etcd_client import EtcdClient
from elasticd.journal import recent_events
from elasticd.rendezvous import admin
from elasticd.rendezvous.keys import JobKeys


def read_status(config: Config, events: int = 10) -> dict[str, Any]:
    client = EtcdClient(config.etcd.settings(retry_s=3.0))
    try:
        return _read(client, JobKeys(config.job.id, config.etcd.key_prefix), events)
    finally:
        client.close()


def _read(client: EtcdClient, keys: JobKeys, events: int) -> dict[str, Any]:
    state = client.get(keys.state)
    latest = client.get(keys.checkpoint_latest)
    rdzv = admin.current_round(client, keys)
    now = time.time()
    nodes = []
    for kv in sorted(client.get_prefix(keys.nodes), key=lambda kv: kv.key):
        record = json.loads(kv.value)
        nodes.append({
            "node": record.get("node_id"), "state": record.get("state"), "addr": record.get("addr"),
            "agent_pid": record.get("agent_pid"), "daemon_pid": record.get("daemon_pid"),
            "last_update_s_ago": round(now - record.get("updated", now), 1),
            "lease_ttl_left_s": client.lease_ttl(kv.lease_id) if kv.lease_id else None,
        })
    return {
        "job": keys.job_id,
        "state": json.loads(state.value).get("state") if state else "running",
        "nodes": nodes,
        "round": rdzv.round if rdzv else None,
        "world_nodes": rdzv.world_nodes if rdzv else 0,
        "rendezvous_complete": rdzv.complete if rdzv else False,
        "waiting_nodes": rdzv.waiting if rdzv else 0,
        "checkpoint": json.loads(latest.value) if latest else None,
        "events": recent_events(client, keys, events),
    }


def format_status(status: dict[str, Any]) -> str:
    ckpt = status["checkpoint"]
    lines = [
        f"job {status['job']}: {status['state']}",
        f"rendezvous round {status['round']}, {status['world_nodes']} node(s) in the world"
        f"{'' if status['rendezvous_complete'] else ' (forming)'}, {status['waiting_nodes']} waiting",
        f"newest checkpoint: step {ckpt['step']} (by {ckpt['node']})" if ckpt else "newest checkpoint: none",
        "nodes:",
    ]
    for n in status["nodes"]:
        lines.append(f"  {n['node']:<16} {n['state']:<10} addr {n['addr']}, agent pid {n['agent_pid']}, "
                     f"lease {n['lease_ttl_left_s']} s left, updated {n['last_update_s_ago']} s ago")
    lines.append("recent events:")
    for e in status["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
        extra = {k: v for k, v in e.items() if k not in ("kind", "node", "time")}
        lines.append(f"  {when} {e.get('node', '?'):<16} {e.get('kind')} {extra if extra else ''}".rstrip())
    return "\n".join(lines)
