"""The names the daemon tests use, from ``elasticd.lab.local_cluster`` (the one harness), and the
nodes-and-client helper their fixtures share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from elasticd.etcd_client import EtcdClient, EtcdSettings
from elasticd.lab.local_cluster import MLP, DaemonNode, stepping_at, wait_for, write_config
from elasticd.lab.local_cluster import stop_all as stop_nodes

log_lines = DaemonNode.daemon_events      # log_lines(node): the daemon's JSON lines
agent_events = DaemonNode.worker_events   # agent_events(node, event): the workers' lines


@contextlib.contextmanager
def nodes_and_client(endpoint: str) -> Iterator[tuple[list[DaemonNode], EtcdClient]]:
    """A list the test adds its daemons to and a client of their etcd; the daemons are
    stopped (their whole trees) and the client closed whatever the test did."""
    nodes: list[DaemonNode] = []
    client = EtcdClient(EtcdSettings(endpoints=(endpoint,)))
    try:
        yield nodes, client
    finally:
        stop_nodes(nodes)
        client.close()


__all__ = ["MLP", "DaemonNode", "agent_events", "log_lines", "nodes_and_client", "stepping_at",
           "stop_nodes", "wait_for", "write_config"]
