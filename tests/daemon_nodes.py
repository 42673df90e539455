"""Test helpers around elasticd.local_cluster: real daemons on loopback."""

from __future__ import annotations

from elasticd import proctree
from elasticd.local_cluster import MLP, LocalNode, stepping_at, stop_all, write_config

DaemonNode = LocalNode
stop_nodes = stop_all

__all__ = ["MLP", "DaemonNode", "agent_events", "log_lines", "stepping_at", "stop_nodes", "wait_for",
           "write_config"]


def wait_for(predicate, timeout_s: float, what: str, nodes=()) -> None:
    if proctree.wait_for(predicate, timeout_s, 0.1):
        return
    logs = "\n".join(n.log_tail() for n in nodes)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


def log_lines(node: LocalNode) -> list[dict]:
    return node.daemon_events()


def agent_events(node: LocalNode, event: str) -> list[dict]:
    return node.worker_events(event)
