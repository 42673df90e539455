"""The names the daemon tests use, all from ``elasticd.lab.local_cluster`` (the one harness)."""

from __future__ import annotations

from elasticd.lab.local_cluster import MLP, DaemonNode, stepping_at, wait_for, write_config
from elasticd.lab.local_cluster import stop_all as stop_nodes

log_lines = DaemonNode.daemon_events      # log_lines(node): the daemon's JSON lines
agent_events = DaemonNode.worker_events   # agent_events(node, event): the workers' lines

__all__ = ["MLP", "DaemonNode", "agent_events", "log_lines", "stepping_at", "stop_nodes", "wait_for",
           "write_config"]
