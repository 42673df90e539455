"""``elasticd demo``: a whole elastic job with a node crash, on this one machine.

Starts a throw-away etcd, three daemons (one CPU worker each) training the
character-level transformer example, SIGKILLs one whole node partway, restarts
it so it rejoins, and ends with a summary (recovery time, steps lost, rejoin
time, final loss) and a timeline picture. Every process it starts and every
temporary file is removed at the end, on an error, and on Ctrl-C.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elasticd import proctree
from elasticd.local_cluster import CHARLM, Cluster, LocalNode, local_cluster

SAMPLE_EVERY_S = 0.2


@dataclass
class Sample:
    t: float          # seconds since the demo's start
    node: str
    step: int
    world_size: int
    loss: float | None


@dataclass
class Timeline:
    samples: list[Sample] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)      # (t, label)
    checkpoints: list[tuple[float, int]] = field(default_factory=list)  # (t, step)


@dataclass
class Summary:
    steps: int
    total_s: float
    fault_node: str
    fault_at_step: int
    recovery_s: float | None       # crash -> first step of the world of 2
    steps_lost: int | None         # last step before the crash - step resumed from
    rejoin_s: float | None         # restart -> first step of the world of 3 again
    final_loss: float | None
    checkpoints: int
    png: str
    completed: bool


class Demo:
    def __init__(self, out_dir: Path, steps: int, crash_at: int, rejoin_after_s: float,
                 say: Callable[[str], None]) -> None:
        self.out_dir = out_dir
        self.steps = steps
        self.crash_at = crash_at
        self.rejoin_after_s = rejoin_after_s
        self.say = say
        self.root = Path(tempfile.mkdtemp(prefix="elasticd-demo-"))
        self.nodes: list[LocalNode] = []
        self.timeline = Timeline()
        self.t0 = time.time()

    # -- orchestration ------------------------------------------------------------------

    def run(self) -> Summary:
        # Subreaper: workers orphaned by the SIGKILLed node are re-parented here, so the
        # cluster's cleanup still finds and kills them.
        proctree.become_subreaper()
        try:
            with local_cluster(self.root) as cluster:
                self.say(f"etcd {cluster.endpoint} is up; starting 3 nodes (one CPU worker each)")
                return self._scenario(cluster)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _scenario(self, cluster: Cluster) -> Summary:
        entry = [CHARLM, "--max-steps", str(self.steps), "--log-every", "50"]
        self.nodes = [cluster.daemon(n, "demo", entrypoint=entry, every_steps=25)
                      for n in ("node-a", "node-b", "node-c")]
        self._wait("the world of 3 to train", lambda: self._world() == 3, 180)
        self._wait(f"step {self.crash_at}", lambda: self._step() >= self.crash_at, 600)
        victim = self._victim()
        before = self._step()
        crash = self._now()
        victim.kill()
        self._mark(crash, f"SIGKILL {victim.name}")
        self.say(f"step {before}: killed {victim.name} (daemon, agent and worker) with SIGKILL")
        survivors = [n for n in self.nodes if n is not victim]
        self._wait("the survivors to train at world size 2",
                   lambda: self._world(survivors, after=crash) == 2, 120)
        recovery = self._now() - crash
        resumed = self._resumed_step(survivors, crash)
        self.say(f"recovered in {recovery:.1f} s at world size 2, resumed from step {resumed}")
        self._wait(f"{self.rejoin_after_s:.0f} s before {victim.name} comes back",
                   lambda: self._now() - crash >= self.rejoin_after_s, self.rejoin_after_s + 5)
        back = self._now()
        victim.start()
        self._mark(back, f"restart {victim.name}")
        self.say(f"restarted {victim.name}; it rejoins the job")
        self._wait("world size 3 again", lambda: self._world(after=back) == 3, 180)
        rejoin = self._now() - back
        self.say(f"{victim.name} rejoined in {rejoin:.1f} s; training to step {self.steps}")
        completed = self._wait_done()
        return self._summary(victim, before, recovery, resumed, rejoin, completed)

    def _wait_done(self) -> bool:
        done = self._wait("the job to complete", lambda: not any(n.running() for n in self.nodes), 900)
        return done and all(n.proc.returncode == 0 for n in self.nodes)

    # -- observation ---------------------------------------------------------------------

    def _now(self) -> float:
        return time.time() - self.t0

    def _sample(self) -> None:
        now = self._now()
        for node in self.nodes:
            if not node.running():
                continue  # a dead node's last progress file is history, not its present
            p = node.progress()
            if p and p.get("step") is not None:
                self.timeline.samples.append(Sample(now, node.name, p["step"], p.get("world_size", 0),
                                                    p.get("loss")))
        latest = self._newest_checkpoint()
        if latest is not None and (not self.timeline.checkpoints or
                                   self.timeline.checkpoints[-1][1] != latest):
            self.timeline.checkpoints.append((now, latest))

    def _newest_checkpoint(self) -> int | None:
        steps = [int(p.name.split("-")[1]) for p in (self.root / "ckpt").glob("step-*")
                 if (p / "manifest.json").exists()]
        return max(steps, default=None)

    def _wait(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        last_said = 0.0
        while time.monotonic() < deadline:
            self._sample()
            if predicate():
                return True
            if time.monotonic() - last_said > 10:
                last_said = time.monotonic()
                self.say(f"  waiting for {what} (step {self._step()}, world size {self._world()})")
            time.sleep(SAMPLE_EVERY_S)
        raise TimeoutError(f"the demo waited {timeout_s:.0f} s for {what}; logs are in {self.root}")

    def _live(self, nodes: list[LocalNode] | None = None) -> list[dict]:
        return [p for n in (nodes or self.nodes) if n.running() and (p := n.progress())]

    def _step(self) -> int:
        return max((p.get("step", 0) for p in self._live()), default=0)

    def _world(self, nodes: list[LocalNode] | None = None, after: float = -1.0) -> int:
        fresh = [p for p in self._live(nodes) if p.get("time", 0) - self.t0 > after]
        return min((p.get("world_size", 0) for p in fresh), default=0) if fresh else 0

    def _victim(self) -> LocalNode:
        return next(n for n in self.nodes if (n.progress() or {}).get("rank") != 0)

    def _resumed_step(self, nodes: list[LocalNode], since: float) -> int | None:
        """The step the new world resumed from: its workers' "resumed" log line, else the
        step before the first one sampled at world size 2."""
        steps = [e["step"] for n in nodes for e in n.worker_events("resumed")
                 if e.get("time", 0) - self.t0 > since]
        if steps:
            return min(steps)
        sampled = [s.step for s in self.timeline.samples if s.t > since and s.world_size == 2]
        return min(sampled) - 1 if sampled else None

    def _mark(self, t: float, label: str) -> None:
        self.timeline.marks.append((t, label))

    # -- results -------------------------------------------------------------------------

    def _summary(self, victim: LocalNode, before: int, recovery: float, resumed: int | None,
                 rejoin: float, completed: bool) -> Summary:
        losses = [s.loss for s in self.timeline.samples if s.loss is not None]
        png = self.out_dir / "timeline.png"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        draw_timeline(self.timeline, png)
        summary = Summary(
            steps=self.steps, total_s=round(self._now(), 1), fault_node=victim.name,
            fault_at_step=before, recovery_s=round(recovery, 2),
            steps_lost=None if resumed is None else before - resumed, rejoin_s=round(rejoin, 2),
            final_loss=losses[-1] if losses else None, checkpoints=len(self.timeline.checkpoints),
            png=str(png), completed=completed)
        (self.out_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
        return summary


def draw_timeline(timeline: Timeline, png: Path) -> None:
    """World size and step progress per node over time, with faults and checkpoints."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_world, ax_step) = plt.subplots(2, 1, sharex=True, figsize=(10, 6),
                                            gridspec_kw={"height_ratios": [1, 2]})
    for node in sorted({s.node for s in timeline.samples}):
        mine = [s for s in timeline.samples if s.node == node]
        ax_world.step([s.t for s in mine], [s.world_size for s in mine], where="post", label=node)
        ax_step.plot([s.t for s in mine], [s.step for s in mine], ".", markersize=2, label=node)
    for t, step in timeline.checkpoints:
        ax_step.plot([t], [step], "k|", markersize=10)
    for ax in (ax_world, ax_step):
        for t, label in timeline.marks:
            ax.axvline(t, color="red" if "KILL" in label else "green", linestyle="--", linewidth=1)
    for t, label in timeline.marks:
        ax_world.annotate(label, (t, 0.3), rotation=90, fontsize=8, xytext=(3, 0),
                          textcoords="offset points")
    ax_world.set_ylabel("world size")
    ax_world.set_ylim(0, 3.5)
    ax_world.legend(loc="upper right", fontsize=8)
    ax_step.set_ylabel("step (| = checkpoint)")
    ax_step.set_xlabel("seconds since start")
    fig.suptitle("elasticd demo: 3 nodes, one SIGKILLed and restarted")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def format_summary(s: Summary) -> str:
    lost = "unknown" if s.steps_lost is None else str(s.steps_lost)
    loss = "n/a" if s.final_loss is None else f"{s.final_loss:.3f}"
    return "\n".join([
        f"job {'completed' if s.completed else 'did NOT complete'}: {s.steps} steps in {s.total_s:.0f} s",
        f"fault: SIGKILL of {s.fault_node} at step {s.fault_at_step}",
        f"  recovery (crash -> first step at world size 2): {s.recovery_s:.1f} s",
        f"  steps lost (redone from the last checkpoint):   {lost}",
        f"  rejoin (restart -> first step at world size 3): {s.rejoin_s:.1f} s",
        f"checkpoints committed: {s.checkpoints}; final loss {loss}",
        f"timeline picture: {s.png}",
    ])
