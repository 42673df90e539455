"""Prometheus metrics of one daemon, on their own registry (``[metrics] port``).

``elasticd_etcd_up`` is set every cycle (``Daemon._log``) from ``observer.JobReader``'s
view: 1 if the loop's last read of the job's keys (at most once a second: ``/state``, this
node's drain key, the rendezvous state, round pointer and closed key, ``/generation``, and
a new keyed round's world record) succeeded, 0 from a failed read until the next one
succeeds. The membership lease's own etcd calls do not set it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from elasticd.supervisor import Phase


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.phase = Gauge("elasticd_phase", "1 for the daemon's current phase", ["phase"], registry=r)
        self.world_size = Gauge("elasticd_world_size", "Workers in the current world", registry=r)
        self.step = Gauge("elasticd_step", "Last completed training step", registry=r)
        self.peers = Gauge("elasticd_peers", "Other nodes registered in etcd", registry=r)
        # Set each cycle from the JobReader's view (daemon._log): membership has its own
        # outage state, this gauge is the loop's once-a-second read of the job's keys.
        self.etcd_up = Gauge("elasticd_etcd_up", "1 if etcd answered the daemon's last "
                             "once-a-second read of the job's keys (/state, the drain key, "
                             "the rendezvous state, round and closed keys, /generation, a new "
                             "round's world); 0 while it fails",
                             registry=r)
        self.checkpoint_step = Gauge("elasticd_checkpoint_step", "Newest committed checkpoint step",
                                     registry=r)
        self.agent_starts = Counter("elasticd_agent_starts", "torchrun agent starts", registry=r)
        self.worker_restarts = Counter("elasticd_worker_restarts", "Worker-group restarts by cause",
                                       ["cause"], registry=r)
        self.recovery_seconds = Histogram(
            "elasticd_recovery_seconds", "From a fault seen by this daemon to the next completed "
            "step, by kind (peer-crashed, peer-silent, peer-left, worker-crash, agent-crash, hang; "
            "in-place: from the loss decision to the workers' re-form report)",
            ["kind"], buckets=(0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120, 300, 600), registry=r)
        self.steps_per_second = Gauge("elasticd_steps_per_second",
                                      "Training steps per second (median of recent steps)", registry=r)
        self.rendezvous_round = Gauge("elasticd_rendezvous_round",
                                      "torch's rendezvous round of the current world", registry=r)
        self.checkpoint_age = Gauge("elasticd_checkpoint_age_seconds",
                                    "Seconds since the newest committed checkpoint step changed",
                                    registry=r)
        self.etcd_round_trip = Histogram(
            "elasticd_etcd_round_trip_seconds", "Duration of the loop's periodic etcd read",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2), registry=r)
        self.evictions = Counter("elasticd_peer_evictions", "Peers evicted from the rendezvous, "
                                 "by how they went (crashed, silent, left)", ["how"], registry=r)

        self.drain_seconds = Histogram(
            "elasticd_drain_seconds", "From this node's drain request to its agent's end, by how "
            "(in-place: the others went on; coordinated-stop: every rank stopped)", ["how"],
            buckets=(0.5, 1, 2, 3, 5, 8, 13, 20, 30, 60, 120), registry=r)
        self.join_seconds = Histogram(
            "elasticd_join_seconds", "From this node's agent start to its workers' entry into "
            "the live world, by how (in-place: nobody restarted)", ["how"],
            buckets=(1, 2, 3, 5, 8, 13, 20, 30, 60, 120), registry=r)
        self.in_place_recoveries = Counter(
            "elasticd_in_place_recoveries", "In-place re-forms after a lost peer or a drain, by outcome "
            "(ok; fallback: the workers were restarted instead)", ["outcome"], registry=r)

    def serve(self, addr: str, port: int) -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def set_phase(self, phase: Phase) -> None:
        for p in Phase:
            self.phase.labels(p.value).set(1 if p is phase else 0)
