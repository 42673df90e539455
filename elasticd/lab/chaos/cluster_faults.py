"""Faults of the etcd cluster, of the cloud and of the machines around the nodes
(registered in ``elasticd.lab.chaos.faults.INJECTORS`` with the others):

* ``etcd-leader-kill``: SIGKILL the member that leads a 3-member cluster; the other two
  elect a new leader and the daemons, which hold every endpoint, go on through them; the
  heal restarts the old leader from its data dir (it rejoins as a follower);
* ``etcd-quorum-loss``: SIGKILL the leader and one follower, hold longer than the nodes'
  lease TTL with no quorum (no write, no linearizable read, no lease expires: a lease
  needs a leader to expire it), then restart both: the quorum, and a leader, are back.

Both need ``etcd_members = 3`` (the scenario sets it when one of them is planned). What
the job must do: train on (workers never wait on etcd) and lose no step; the daemons'
etcd outage (membership frozen) ends soon after a leader exists again. The invariant
``etcd-outage-bounded`` (elasticd.lab.chaos.invariants) checks it from the daemons' logs.

* ``preemption-notice``: the node's fake metadata server (elasticd.lab.fake_metadata, on
  127.0.0.1; the runner starts one per node) announces a GCE preemption, 30 s ahead;
* ``flapping-node``: the node's whole tree SIGKILLed and restarted, several times;
* ``checkpoint-dir-full``: the checkpoint directory's filesystem (a small tmpfs: the
  injector refuses a large one) filled up under the live job, then freed.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import ClassVar

from elasticd import proctree
from elasticd.lab.chaos.faults import Detail, InjectionError, Injector, Target
from elasticd.lab.embedded_etcd import EmbeddedEtcdCluster, EtcdMember
from elasticd.lab.local_cluster import DaemonNode
from elasticd.preemption import GCE_NOTICE_WINDOW_S

ELECTION_TIMEOUT_S = 30.0   # a loaded 2-core machine can take seconds to elect


def etcd_cluster(t: Target) -> EmbeddedEtcdCluster:
    if not isinstance(t.etcd, EmbeddedEtcdCluster):
        raise InjectionError("this fault needs a 3-member etcd cluster (etcd_members = 3)")
    return t.etcd


def _leader(cluster: EmbeddedEtcdCluster) -> EtcdMember:
    leader = None

    def found() -> bool:
        nonlocal leader
        leader = cluster.leader()
        return leader is not None

    if not proctree.wait_for(found, ELECTION_TIMEOUT_S, 0.1):
        raise InjectionError(f"the etcd cluster has no leader (waited {ELECTION_TIMEOUT_S:.0f} s)")
    return leader


def _elected_after(cluster: EmbeddedEtcdCluster, old: EtcdMember, t0: float) -> float | None:
    """Seconds from ``t0`` until a member other than ``old`` leads (None: not in time)."""
    ok = proctree.wait_for(lambda: cluster.leader() not in (None, old), ELECTION_TIMEOUT_S, 0.05)
    return round(time.monotonic() - t0, 2) if ok else None


class EtcdLeaderKill(Injector):
    name = "etcd-leader-kill"
    summary = "SIGKILL the leader of the 3-member etcd cluster; restart it from its data dir"
    target_rule = "cluster"
    replaces_workers = False     # training goes on; the daemons fail over to another member
    etcd_members: ClassVar[int] = 3
    hold_s = 3.0

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        cluster = etcd_cluster(t)
        self._old = _leader(cluster)
        t0 = time.monotonic()
        cluster.kill(self._old)
        return {"member": self._old.name, "new_leader_after_s": _elected_after(cluster, self._old, t0)}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        etcd_cluster(t).start([self._old])
        return {"restarted": self._old.name}


class EtcdQuorumLoss(Injector):
    name = "etcd-quorum-loss"
    summary = "SIGKILL two of the three etcd members (the leader among them), hold, restart both"
    target_rule = "cluster"
    replaces_workers = False
    etcd_members: ClassVar[int] = 3

    @staticmethod
    def held_s(t: Target) -> float:
        return t.lease_ttl_s + 3.0   # longer than a lease: none may expire meanwhile

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        cluster = etcd_cluster(t)
        leader = _leader(cluster)
        self._down = [leader, next(m for m in cluster.members if m is not leader and m.running())]
        for m in self._down:
            cluster.kill(m)
        return {"members": [m.name for m in self._down], "held_s": self.held_s(t)}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        cluster = etcd_cluster(t)
        time.sleep(self.held_s(t))
        # The evidence that the fault bit: the member left alone had no leader.
        no_leader = cluster.leader() is None
        t0 = time.monotonic()
        cluster.start(self._down)
        return {"no_leader_while_held": no_leader, "quorum_back_s": round(time.monotonic() - t0, 2)}


class PreemptionNotice(Injector):
    """The node's (fake) GCE metadata server says ``preempted``: GCE takes the VM 30 s
    later. The daemon must drain (a checkpoint at an agreed step, exit 0) within those
    30 s, losing no step; a VM that did not is taken (SIGKILL) at the deadline, as GCE
    would. Healed by a replacement VM: the node restarts with the notice withdrawn."""

    name = "preemption-notice"
    summary = "the fake metadata server announces a GCE preemption (30 s deadline) for the node"
    needs_metadata: ClassVar[bool] = True
    phases: ClassVar[tuple[str, ...]] = ("inject", "drain", "restart", "round", "join")

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        server = t.metadata.get(victim.name)
        if server is None:
            raise InjectionError(f"node {victim.name} has no metadata server (the runner starts "
                                 "them when a preemption-notice is planned)")
        self._t0 = time.monotonic()
        server.announce_gce()
        return {"deadline_s": GCE_NOTICE_WINDOW_S}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        left = GCE_NOTICE_WINDOW_S - (time.monotonic() - self._t0)
        try:
            code = victim.proc.wait(timeout=max(left, 0.1))
            drained = round(time.monotonic() - self._t0, 2)
        except subprocess.TimeoutExpired:
            victim.kill()   # the deadline: the cloud takes the VM
            code, drained = None, None
        t.metadata[victim.name].gce_preempted = False   # the replacement VM has no notice
        victim.start()
        return {"drain_exit_code": code, "drained_s": drained, "restarted": True}


class FlappingNode(Injector):
    """The node dies (SIGKILL of its whole tree) and comes back FLAPS times, UP_S apart:
    a machine with a bad power supply, or a VM the cloud keeps reclaiming."""

    name = "flapping-node"
    summary = "SIGKILL the whole node and restart it, 3 times, a few seconds apart"
    FLAPS: ClassVar[int] = 3
    DOWN_S: ClassVar[float] = 2.0
    UP_S: ClassVar[float] = 5.0
    hold_s = DOWN_S
    phases: ClassVar[tuple[str, ...]] = ("inject", "reform", "join")

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        pids = []
        for flap in range(self.FLAPS):
            pids.append(victim.proc.pid)
            victim.kill()
            if flap < self.FLAPS - 1:   # the last comeback is the heal's
                time.sleep(self.DOWN_S)
                victim.start()
                time.sleep(self.UP_S)
        return {"flaps": self.FLAPS, "daemon_pids": pids}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        victim.start()
        return {"restarted": True}


FILLER = "chaos-filler"       # not a step, temp or state name: the checkpoint code leaves it alone
MAX_FILL_BYTES = 1 << 30      # never fill a filesystem larger than this (the machine's own disk)


def fill(directory: Path, chunk: int = 1 << 20) -> int:
    """Write ``directory/FILLER`` until the filesystem is full (ENOSPC); its size in bytes.
    ``InjectionError`` if the filesystem is larger than MAX_FILL_BYTES."""
    st = os.statvfs(directory)
    total = st.f_blocks * st.f_frsize
    if total > MAX_FILL_BYTES:
        raise InjectionError(f"{directory} is on a filesystem of {total >> 20} MiB: refusing to fill "
                             f"it; mount a small tmpfs there (at most {MAX_FILL_BYTES >> 20} MiB)")
    written = 0
    block = b"\0" * chunk
    with open(directory / FILLER, "ab", buffering=0) as f:   # unbuffered: no flush at close
        while True:
            try:
                written += f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if chunk == 1:
                    return written
                chunk //= 16           # top up to the last bytes
                block = b"\0" * chunk


class CheckpointDirFull(Injector):
    """The checkpoint directory's filesystem (a small tmpfs the test mounts) filled up
    under the live job for HOLD_S, several checkpoint intervals; then the filler is
    removed. Committed checkpoints must stay whole, the job must go on (the periodic
    saves fail) or stop clearly, and it must commit checkpoints again once there is space."""

    name = "checkpoint-dir-full"
    summary = "fill the checkpoint directory's (small tmpfs) filesystem for 15 s, then free it"
    target_rule = "cluster"
    replaces_workers = False
    drawn_by_default = False     # the checkpoint directory must be a small tmpfs first
    HOLD_S: ClassVar[float] = 15.0

    def inject(self, t: Target, victim: DaemonNode | None) -> Detail:
        written = fill(t.ckpt_dir)
        return {"filled_bytes": written, "free_bytes": shutil.disk_usage(t.ckpt_dir).free}

    def heal(self, t: Target, victim: DaemonNode | None) -> Detail:
        time.sleep(self.HOLD_S)
        (t.ckpt_dir / FILLER).unlink()
        return {"freed": True}
