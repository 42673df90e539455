"""The names the plain-torchrun tests use, all from ``elasticd.lab.local_cluster``: torchrun
agents (etcd3 rendezvous) running ``tests/workers/allreduce.py``, and its reports."""

from __future__ import annotations

from elasticd.lab.local_cluster import ALLREDUCE, FAST_RDZV_CONF, latest, reports, world_after
from elasticd.lab.local_cluster import AllreduceNode as TorchrunNode
from elasticd.lab.local_cluster import stop_allreduce as stop_all
from elasticd.lab.local_cluster import wait_for as wait_until

WORKER = ALLREDUCE

__all__ = ["FAST_RDZV_CONF", "WORKER", "TorchrunNode", "latest", "reports", "stop_all", "wait_until",
           "world_after"]
