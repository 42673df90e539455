"""The scale harness (benchmarks/scale.py) runs end to end on a few nodes, and its
counters agree with each other: what the clients say they sent reached etcd."""

from __future__ import annotations

import argparse

import psutil
import pytest

from benchmarks import scale

# The adapter calls that are one unary etcd request each, and the etcd methods they become.
UNARY_CALLS = ("get", "get_prefix", "list_prefix", "get_many", "put", "put_or_create", "delete",
               "delete_if_revision", "grant_lease", "lease_ttl", "revoke_lease", "count_prefix",
               "first_created", "create_all")
UNARY_METHODS = ("Range", "Txn", "Put", "DeleteRange", "LeaseGrant", "LeaseTimeToLive",
                 "LeaseRevoke")


@pytest.mark.slow
@pytest.mark.parametrize("system", ["elasticd", "elasticd-keyed"])
def test_four_nodes_form_lose_one_and_reform(etcd_server, system):
    args = argparse.Namespace(procs=1, form_timeout_s=60.0, reform_timeout_s=40.0, settle_s=0.2,
                              steady_s=1.5, etcd=etcd_server.endpoint, etcd_dir=None,
                              keep_dir=None)
    leftovers: list[int] = []
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cell = scale.run_cell(system, 4, args, leftovers)

    assert leftovers == []
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert cell["error_count"] == 0, cell["errors"]
    assert cell["form"]["formed"] and cell["form"]["form_s"] > 0
    assert cell["reform"]["reformed"] and cell["reform"]["reform_s"] > 0
    steady = cell["steady"]
    for figure in ("etcd_requests_per_node_s", "etcd_bytes_per_node_s", "probes_per_node_s",
                   "cpu_per_node", "client_calls_per_node_s"):
        assert steady[figure] > 0, figure
    # Each daemon probes its 2 ring successors (node.probe_neighbours) every 0.5 s, not
    # all 3 peers (that would be 6 a second).
    # A window of steady_s holds at most steady_s / 0.5 + 1 probe rounds (CI once counted 4
    # rounds in 1.5 s: 5.23/s against a flat 4.8 bound); all 3 peers would be >= 6/s.
    rounds = args.steady_s / 0.5 + 1
    assert steady["probes_per_node_s"] <= 2 * rounds / args.steady_s * 1.02

    for window in (cell["form"]["window"], steady, cell["reform"]["window"]):
        client = sum(v for k, v in window["client_counts"].items()
                     if k.split(".", 1)[1] in UNARY_CALLS)
        server = sum(window["etcd_counts"].get(m, 0) for m in UNARY_METHODS)
        # A retried call is one call for the client and two requests for etcd; nothing
        # else talks to this etcd meanwhile (the harness reads /metrics over HTTP).
        assert client > 0
        assert client <= server + 2 <= 1.2 * client + 10, (client, server)
