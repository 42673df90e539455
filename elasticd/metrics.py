"""Prometheus metrics of one daemon, on their own registry (``[metrics] port``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from elasticd.supervisor import Phase


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.phase = Gauge("elasticd_phase", "1 for the daemon's current phase", ["phase"], registry=r)
        self.world_size = Gauge("elasticd_world_size", "Workers in the current world", registry=r)
        self.step = Gauge("elasticd_step", "Last completed training step", registry=r)
        self.peers = Gauge("elasticd_peers", "Other nodes registered in etcd", registry=r)
        self.etcd_up = Gauge("elasticd_etcd_up", "1 if etcd answered the last membership read",
                             registry=r)
        self.checkpoint_step = Gauge("elasticd_checkpoint_step", "Newest committed checkpoint step",
                                     registry=r)
        self.agent_starts = Counter("elasticd_agent_starts", "torchrun agent starts", registry=r)
        self.worker_restarts = Counter("elasticd_worker_restarts", "Worker-group restarts by cause",
                                       ["cause"], registry=r)
        self.evictions = Counter("elasticd_peer_evictions", "Peers evicted from the rendezvous, "
                                 "by how they went (crashed, silent, left)", ["how"], registry=r)

    def serve(self, addr: str, port: int) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def set_phase(self, phase: Phase) -> None:
        for p in Phase:
            self.phase.labels(p.value).set(1 if p is phase else 0)
