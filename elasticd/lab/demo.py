"""``elasticd demo``: a whole elastic job on this one machine, and plain torchrun beside it.

Part 1, elasticd: a throw-away etcd and three daemons (one CPU worker each, the MLP
example) form a world of 3. One node is SIGKILLed (daemon, agent and worker at once);
the survivors go on at world size 2. The node is restarted and rejoins (world size 3);
another node is drained with ``elasticd drain`` (world size 2, no step lost; it exits 0).

Part 2 (``--compare``, the default), plain torchrun with the c10d rendezvous tuned as
in ``benchmarks/mttr.py`` (system b), through the same crash of a non-rank-0 node.

Each phase prints one line with its duration (from the action to the first training
step of the new world, read from the workers' progress files); the end prints both
systems side by side, writes ``summary.json`` and ``timeline.png`` (one lane per
node, faults and recoveries annotated, steps and checkpoints). Every process it
starts and every temporary file is removed at the end, on an error, and on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elasticd import proctree
from elasticd.lab.local_cluster import MLP, Node, local_cluster

POLL_S = 0.1                 # progress files and the checkpoint dir are read this often
GAP_S = 1.5                  # step records further apart than this: two training stretches
CHECKPOINT_EVERY = 20
NAMES = ("node-a", "node-b", "node-c")
# benchmarks/mttr.py's system b: torchrun c10d, tuned (1 s x 2 keep-alive, 0.1 s monitor).
TUNED_C10D_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
ELASTICD, TORCHRUN = "elasticd", "torchrun c10d (tuned)"
STEP_EVENTS = ("step", "checkpoint")


@dataclass
class Sample:
    t: float                 # wall time (time.time()) of the reading
    node: str
    alive: bool
    event: str | None = None
    step: int | None = None
    world_size: int | None = None
    rec_t: float | None = None   # the record's own wall time (the step's end)
    loss: float | None = None


@dataclass
class Phase:
    kind: str                # start | crash | rejoin | drain
    node: str | None         # the node acted on
    start: float             # wall time of the action
    end: float | None = None  # the first step of the new world
    world_size: int = 0
    steps_lost: int | None = None
    at_step: int | None = None
    note: str = ""

    @property
    def duration_s(self) -> float | None:
        return None if self.end is None else round(self.end - self.start, 2)

    def as_dict(self) -> dict:
        return asdict(self) | {"duration_s": self.duration_s}


@dataclass
class SystemRun:
    system: str
    nodes: list[str]
    started: float
    origin: float = 0.0      # wall time of the crash: t = 0 in the picture
    samples: list[Sample] = field(default_factory=list)
    checkpoints: list[tuple[float, int]] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    final_step: int | None = None
    final_loss: float | None = None

    def phase(self, kind: str) -> Phase | None:
        return next((p for p in self.phases if p.kind == kind), None)

    def as_dict(self) -> dict:
        return {"system": self.system, "nodes": self.nodes, "phases": [p.as_dict() for p in self.phases],
                "final_step": self.final_step, "final_loss": self.final_loss,
                "checkpoints": len(self.checkpoints)}


@dataclass
class Settings:
    crash_at: int = 30           # the crash comes at this step of the world of 3
    rejoin_after: float = 1.0    # seconds of training at world size 2 before the restart
    drain_after: float = 2.0     # seconds at world size 3 again before the drain
    stop_after: float = 1.5      # seconds of training after the last recovery, then the end
    step_sleep: float = 0.05
    compare: bool = True
    timeout_s: float = 120.0     # cap of any one wait


class Observer:
    """One system's nodes, read every ``POLL_S``: progress records, liveness, checkpoints."""

    def __init__(self, run: SystemRun, nodes: list[Node], ckpt: Path, say: Callable[[str], None],
                 timeout_s: float) -> None:
        self.run, self.nodes, self.ckpt, self.say, self.timeout_s = run, nodes, ckpt, say, timeout_s
        self._seen_ckpt: set[int] = set()

    def sample(self) -> None:
        now = time.time()
        for node in self.nodes:
            alive = node.running()
            p = node.progress() if alive else None   # a dead node's file is history
            if p and isinstance(p.get("step"), int):
                self.run.samples.append(Sample(now, node.name, True, p.get("event"), p["step"],
                                               p.get("world_size"), p.get("time"), p.get("loss")))
            else:
                self.run.samples.append(Sample(now, node.name, alive))
        for d in self.ckpt.glob("step-*") if self.ckpt.exists() else []:
            manifest = d / "manifest.json"
            step = int(d.name.split("-")[1])
            if step not in self._seen_ckpt and manifest.exists():
                self._seen_ckpt.add(step)
                try:
                    self.run.checkpoints.append((manifest.stat().st_mtime, step))
                except OSError:
                    self.run.checkpoints.append((now, step))

    def wait(self, what: str, predicate: Callable[[], object], timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        last_said = time.monotonic()
        while True:
            self.sample()
            if predicate():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.run.system}: waited {timeout_s or self.timeout_s:.0f} s "
                                   f"for {what} (step {self.step()}); the machine may be overloaded")
            if time.monotonic() - last_said > 15:
                last_said = time.monotonic()
                self.say(f"  {self.run.system}: waiting for {what} (step {self.step()})")
            time.sleep(POLL_S)

    def pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        self.wait(f"{seconds:.0f} s", lambda: time.monotonic() >= end, seconds + 5)

    # -- what the samples say
    def latest(self, node: Node) -> Sample | None:
        for s in reversed(self.run.samples):
            if s.node == node.name:
                return s if s.step is not None else None
        return None

    def step(self) -> int:
        return max((s.step for n in self.nodes if (s := self.latest(n))), default=0)

    def first_step(self, nodes: list[Node], world: int, since: float) -> float | None:
        """Once every node of ``nodes`` has stepped at ``world`` after ``since``: the time of
        the new world's first step (the earliest such record), else None."""
        firsts = []
        for node in nodes:
            times = [s.rec_t for s in self.run.samples if s.node == node.name and s.world_size == world
                     and s.event in STEP_EVENTS and s.rec_t and s.rec_t > since]
            if not times:
                return None
            firsts.append(min(times))
        return min(firsts)

    def last_step(self, world: int, before: float) -> int | None:
        steps = [s.step for s in self.run.samples if s.world_size == world and s.event in STEP_EVENTS
                 and s.rec_t and s.rec_t <= before]
        return max(steps, default=None)

    def resumed(self, nodes: list[Node], world: int, since: float, until: float) -> int | None:
        """The step the new world resumed from: its workers' ``resumed`` line, else the
        step before its first sampled one."""
        steps = [e["step"] for n in nodes for e in n.worker_events("resumed")
                 if since < e.get("time", 0) <= until + 1 and isinstance(e.get("step"), int)]
        if steps:
            return min(steps)
        sampled = [s.step for s in self.run.samples if s.world_size == world and s.rec_t
                   and s.rec_t > since and s.event in STEP_EVENTS]
        return min(sampled) - 1 if sampled else None

    def until_world(self, phase: Phase, nodes: list[Node], world: int, old_world: int) -> Phase:
        """Wait for ``nodes`` to step at ``world`` after ``phase.start``; fill end and steps lost."""
        self.wait(f"world size {world}", lambda: self.first_step(nodes, world, phase.start) is not None)
        phase.end = self.first_step(nodes, world, phase.start)
        phase.world_size = world
        if old_world:
            old = self.last_step(old_world, phase.end)
            resumed = self.resumed(nodes, world, phase.start, phase.end)
            if old is not None and resumed is not None:
                phase.steps_lost = max(old - resumed, 0)
        self.run.phases.append(phase)
        return phase

    def victim(self, avoid: Node | None = None) -> Node:
        """A node that holds neither rank 0 nor (``avoid``) the c10d store."""
        return next(n for n in reversed(self.nodes)
                    if n is not avoid and (self.latest(n) or Sample(0, "", False)).step is not None
                    and (n.progress() or {}).get("rank") not in (0, None))

    def finish(self) -> None:
        stepped = [s for s in self.run.samples if s.step is not None]
        if stepped:
            self.run.final_step = max(s.step for s in stepped)
        losses = [s.loss for s in stepped if s.loss is not None]
        self.run.final_loss = losses[-1] if losses else None


def lost_text(p: Phase) -> str:
    return "" if p.steps_lost is None else f", {p.steps_lost} step{'s' if p.steps_lost != 1 else ''} lost"


class Demo:
    def __init__(self, out_dir: Path, settings: Settings, say: Callable[[str], None]) -> None:
        self.out_dir = out_dir
        self.s = settings
        self.say = say
        self.root = Path(tempfile.mkdtemp(prefix="elasticd-demo-"))
        self.t0 = time.time()
        self.load0 = os.getloadavg()
        self.runs: list[SystemRun] = []

    def run(self) -> dict:
        # Subreaper: workers orphaned by the SIGKILLed node are re-parented here, so the
        # clusters' cleanup still finds and kills them.
        proctree.become_subreaper()
        self.say(f"results (summary.json, timeline.png) go to {self.out_dir}")
        try:
            self.runs.append(self._elasticd(self.root / "elasticd"))
            if self.s.compare:
                self.runs.append(self._torchrun(self.root / "torchrun"))
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        return self._results()

    def _entry(self) -> list[str]:
        return [MLP, "--max-steps", "1000000", "--step-sleep", str(self.s.step_sleep), "--log-every", "50"]

    # -- part 1: elasticd ----------------------------------------------------------------

    def _elasticd(self, root: Path) -> SystemRun:
        with local_cluster(root) as cluster:
            self.say(f"etcd {cluster.endpoint} is up; starting 3 nodes (one CPU worker each)")
            run = SystemRun(ELASTICD, list(NAMES), time.time())
            nodes = [cluster.daemon(n, "demo", entrypoint=self._entry(), min_nodes=2, max_nodes=3,
                                    every_steps=CHECKPOINT_EVERY) for n in NAMES]
            obs = Observer(run, nodes, root / "ckpt", self.say, self.s.timeout_s)
            tag = f"{ELASTICD}:"
            p = obs.until_world(Phase("start", None, run.started), nodes, 3, 0)
            self.say(f"{tag} 3 daemons up -> stepping at world size 3 after {p.duration_s:.1f} s")
            self._crash(obs, tag)
            victim = next(n for n in nodes if n.name == run.phases[-1].node)
            survivors = [n for n in nodes if n is not victim]

            obs.pause(self.s.rejoin_after)
            p = Phase("rejoin", victim.name, time.time())
            victim.start()
            obs.until_world(p, nodes, 3, 0)
            self.say(f"{tag} {victim.name} restarted -> rejoined, stepping at world size 3 "
                     f"after {p.duration_s:.1f} s")

            obs.pause(self.s.drain_after)
            drained = survivors[-1]
            rest = [n for n in nodes if n is not drained]
            p = Phase("drain", drained.name, time.time(), at_step=obs.step())
            request_drain(drained)
            obs.until_world(p, rest, 2, 3)
            obs.wait(f"{drained.name} to exit", lambda: not drained.running(), 60)
            p.note = f"exit {drained.proc.returncode}"
            self.say(f"{tag} {drained.name} drained (`elasticd drain`) -> survivors stepping at world "
                     f"size 2 after {p.duration_s:.1f} s{lost_text(p)}; it exited {drained.proc.returncode}")

            obs.pause(self.s.stop_after)
            obs.finish()
            return run

    def _crash(self, obs: Observer, tag: str, store_host: Node | None = None) -> None:
        obs.wait(f"step {self.s.crash_at}", lambda: obs.step() >= self.s.crash_at)
        victim = obs.victim(avoid=store_host)
        survivors = [n for n in obs.nodes if n is not victim]
        p = Phase("crash", victim.name, time.time(), at_step=obs.step())
        victim.kill()
        obs.run.origin = p.start
        try:
            obs.until_world(p, survivors, 2, 3)
        except TimeoutError:
            p.note = f"not recovered in {self.s.timeout_s:.0f} s"
            obs.run.phases.append(p)
            self.say(f"{tag} {victim.name} crashed (SIGKILL at step {p.at_step}) -> {p.note}")
            raise
        self.say(f"{tag} {victim.name} crashed (SIGKILL at step {p.at_step}) -> survivors stepping at "
                 f"world size 2 after {p.duration_s:.1f} s{lost_text(p)}")

    # -- part 2: plain torchrun, c10d, tuned -----------------------------------------------

    def _torchrun(self, root: Path) -> SystemRun:
        from elasticd.lab.embedded_etcd import free_port

        with local_cluster(root, etcd=False) as cluster:
            self.say("starting plain torchrun beside it: 3 agents, c10d store hosted by node-a, "
                     f"--rdzv-conf={TUNED_C10D_CONF} --monitor-interval=0.1")
            run = SystemRun(TORCHRUN, list(NAMES), time.time())
            port = free_port()
            # torchrun and torch write torchelastic_* and inductor dirs to TMPDIR: keep them
            # in the cluster's root, which goes at the end (elasticd does this for its agents).
            tmp = root / "tmp"
            tmp.mkdir()
            nodes = [cluster.torchrun(
                n, f"demo-{os.getpid()}", endpoint=f"127.0.0.1:{port}", backend="c10d", is_host=i == 0,
                rdzv_conf=TUNED_C10D_CONF, nnodes="2:3", max_restarts=100, monitor_interval_s=0.1,
                script_path=MLP, script_args=tuple(self._entry()[1:]), every_steps=CHECKPOINT_EVERY,
                env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TMPDIR": str(tmp)})
                for i, n in enumerate(NAMES)]
            obs = Observer(run, nodes, root / "ckpt", self.say, self.s.timeout_s)
            tag = f"{TORCHRUN}:"
            p = obs.until_world(Phase("start", None, run.started), nodes, 3, 0)
            self.say(f"{tag} 3 agents up -> stepping at world size 3 after {p.duration_s:.1f} s")
            try:
                self._crash(obs, tag, store_host=nodes[0])
                obs.pause(self.s.stop_after)
            except TimeoutError:
                pass  # reported as "not recovered" in the summary
            obs.finish()
            return run

    # -- results -------------------------------------------------------------------------

    def _results(self) -> dict:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        png = self.out_dir / "timeline.png"
        draw_timeline(self.runs, png)
        result = {"total_s": round(time.time() - self.t0, 1), "load_avg": list(os.getloadavg()),
                  "load_avg_start": list(self.load0),
                  "png": str(png), "settings": asdict(self.s),
                  "systems": {r.system: r.as_dict() for r in self.runs}}
        (self.out_dir / "summary.json").write_text(json.dumps(result, indent=2))
        (self.out_dir / "timeline.json").write_text(json.dumps([asdict(r) for r in self.runs]))
        return result


def load_runs(path: Path) -> list[SystemRun]:
    """The raw timelines a demo wrote (``timeline.json``), to redraw the picture."""
    runs = []
    for d in json.loads(path.read_text()):
        run = SystemRun(**{k: v for k, v in d.items() if k not in ("samples", "checkpoints", "phases")})
        run.samples = [Sample(**x) for x in d["samples"]]
        run.checkpoints = [tuple(x) for x in d["checkpoints"]]
        run.phases = [Phase(**x) for x in d["phases"]]
        runs.append(run)
    return runs


def request_drain(node: Node) -> None:
    """What ``elasticd drain --config <node's config>`` does: put the node's drain key."""
    from elasticd.config import load_config
    from elasticd.etcd_client import EtcdClient
    from elasticd.rendezvous.keys import JobKeys

    config = load_config(str(node.config_path))
    keys = JobKeys(config.job.id, config.etcd.key_prefix)
    client = EtcdClient(config.etcd.settings(retry_s=5.0))
    try:
        client.put(keys.drain(node.name), json.dumps({"reason": "elasticd demo"}).encode())
    finally:
        client.close()


# -- the picture -------------------------------------------------------------------------

WORLD_COLORS = {3: "#2c7fb8", 2: "#f39c12", 1: "#d7301f"}
ACTION_COLORS = {"crash": "#c0392b", "rejoin": "#27ae60", "drain": "#8e44ad"}
ACTION_TEXT = {"crash": "SIGKILL {node}", "rejoin": "restart {node}", "drain": "drain {node}"}


def lanes(run: SystemRun, node: str) -> tuple[list[tuple[float, float]], list[tuple[float, float, int]]]:
    """(alive intervals, training intervals with their world size) of one node, in wall time."""
    mine = [s for s in run.samples if s.node == node]
    alive: list[tuple[float, float]] = []
    start = None
    for prev, s in zip([None, *mine], mine, strict=False):
        if s.alive and start is None:
            start = s.t if prev is None else prev.t
        elif not s.alive and start is not None:
            alive.append((start, s.t))
            start = None
    if start is not None:
        alive.append((start, mine[-1].t))
    records = sorted({(s.rec_t, s.world_size) for s in mine
                      if s.rec_t and s.event in STEP_EVENTS and s.world_size})
    training: list[tuple[float, float, int]] = []
    for t, world in records:
        if training and training[-1][2] == world and t - training[-1][1] < GAP_S:
            training[-1] = (training[-1][0], t, world)
        else:
            training.append((t, t, world))
    return alive, training


def draw_timeline(runs: list[SystemRun], png: Path) -> None:
    """Per system: one lane per node (up, training at world size N, down), the actions
    with their recovery times, and the steps with checkpoint ticks; t = 0 is each
    system's crash."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    times = [t - r.origin for r in runs for s in r.samples for t in (s.t, s.rec_t or s.t)]
    span = (min(times, default=-1.0) - 1, max(times, default=1.0) + 1)
    ratios = [r for run in runs for r in (1.1 + 0.35 * sum(p.kind != "start" for p in run.phases), 1.0)]
    fig, axes = plt.subplots(len(ratios), 1, sharex=True, figsize=(11, 1.2 + sum(ratios) * 1.25),
                             gridspec_kw={"height_ratios": ratios})
    for i, run in enumerate(runs):
        _draw_lanes(axes[2 * i], run, span)
        _draw_steps(axes[2 * i + 1], run)
    axes[-1].set_xlim(*span)
    axes[-1].set_xlabel("seconds since the crash (SIGKILL of one node); each system on its own clock")
    handles = [Patch(color=WORLD_COLORS[w], label=f"training, world size {w}") for w in (3, 2)]
    handles.append(Patch(facecolor="#dddddd", edgecolor="#999999",
                         label="up, not training (starting, rendezvous, restart)"))
    handles.append(Line2D([], [], color="#c0392b", marker="|", linestyle="", markersize=10,
                          markeredgewidth=1.5, label="checkpoint committed"))
    fig.legend(handles=handles, loc="upper center", ncol=4, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.965))
    fig.savefig(png, dpi=90)
    plt.close(fig)


def _draw_lanes(ax, run: SystemRun, span: tuple[float, float]) -> None:
    o = run.origin
    n = len(run.nodes)
    wide = (span[1] - span[0]) * 0.07      # room for a label inside a bar
    for i, node in enumerate(run.nodes):
        y = n - 1 - i
        alive, training = lanes(run, node)
        ax.broken_barh([(a - o, b - a) for a, b in alive], (y - 0.3, 0.6), facecolor="#dddddd",
                       edgecolor="#999999", linewidth=0.5)
        for a, b, world in training:
            ax.broken_barh([(a - o, max(b - a, 0.05))], (y - 0.3, 0.6),
                           facecolor=WORLD_COLORS.get(world, "#7f7f7f"))
            if b - a > wide:
                ax.text((a + b) / 2 - o, y, f"world {world}", ha="center", va="center", fontsize=7,
                        color="white")
        for (_, b), (a, _) in zip(alive, alive[1:], strict=False):
            if a - b > wide:
                ax.text((a + b) / 2 - o, y, "down", ha="center", va="center", fontsize=8, color="#777777")
        if alive and alive[-1][1] < run.samples[-1].t - 1:
            drain = run.phase("drain")
            gone = f"drained, {drain.note}" if drain and drain.node == node else "down"
            ax.text(alive[-1][1] - o + 0.5, y, gone, ha="left", va="center", fontsize=8, color="#777777")
    actions = [p for p in run.phases if p.kind != "start"]
    for k, p in enumerate(actions):
        color = ACTION_COLORS[p.kind]
        ax.axvline(p.start - o, color=color, linestyle="--", linewidth=1)
        head = ACTION_TEXT[p.kind].format(node=p.node)
        if p.duration_s is not None:
            body = f"world size {p.world_size} after {p.duration_s:.1f} s{lost_text(p)}"
        else:
            body = p.note
        level = n - 0.25 + 0.7 * (len(actions) - k)   # one row per action, the first on top
        if p.end is not None:
            ax.annotate("", xy=(p.end - o, level), xytext=(p.start - o, level),
                        arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.5,
                                    "shrinkA": 0, "shrinkB": 0})
        right = p.start - o > span[0] + 0.6 * (span[1] - span[0])
        ax.annotate(f"{head}: {body}", (p.start - o, level), xytext=(-4 if right else 4, 3),
                    textcoords="offset points", fontsize=8, color=color, va="bottom",
                    ha="right" if right else "left", fontweight="bold",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.85})
    start = run.phase("start")
    if start and start.duration_s is not None:
        ax.text(start.start - o, -0.75, f"start -> world size 3 after {start.duration_s:.1f} s",
                fontsize=8, va="center")
    ax.set_yticks(range(n), list(reversed(run.nodes)))
    ax.set_ylim(-1.1, n + 0.5 + 0.7 * len(actions))
    ax.set_title(run.system if run.system == ELASTICD else
                 f"plain {run.system}: {TUNED_C10D_CONF}, store on node-a", fontsize=10, loc="left",
                 fontweight="bold")
    ax.grid(axis="x", alpha=0.3)


def _draw_steps(ax, run: SystemRun) -> None:
    o = run.origin
    pts = sorted({(s.rec_t - o, s.step) for s in run.samples if s.rec_t and s.event in STEP_EVENTS})
    ax.plot([t for t, _ in pts], [s for _, s in pts], ".", markersize=2, color="#333333")
    if run.checkpoints:
        ax.plot([t - o for t, _ in run.checkpoints], [s for _, s in run.checkpoints], "|",
                markersize=12, markeredgewidth=1.5, color="#c0392b")
    for p in run.phases:
        if p.kind != "start":
            ax.axvline(p.start - o, color=ACTION_COLORS[p.kind], linestyle="--", linewidth=1)
    ax.set_ylabel(f"step\n({run.system.split()[0]})", fontsize=9)
    ax.grid(alpha=0.3)


# -- text --------------------------------------------------------------------------------

def _cell(p: Phase | None, lost: bool = False) -> str:
    if p is None:
        return "-"
    if p.duration_s is None:
        return p.note or "-"
    return f"{p.duration_s:.1f} s" + (f", {p.steps_lost} lost" if lost and p.steps_lost is not None else "")


def format_summary(result: dict) -> str:
    runs: list[dict] = list(result["systems"].values())

    def phase(run: dict, kind: str) -> Phase | None:
        d = next((p for p in run["phases"] if p["kind"] == kind), None)
        return None if d is None else Phase(**{k: v for k, v in d.items() if k != "duration_s"})

    rows = [("start -> world size 3", "start", False), ("node crash -> world size 2", "crash", True),
            ("restart -> world size 3 (rejoin)", "rejoin", False),
            ("drain -> world size 2", "drain", True)]
    width = 34
    lines = [f"{'':{width}}" + "".join(f"{r['system']:>24}" for r in runs)]
    for label, kind, lost in rows:
        lines.append(f"{label:{width}}" + "".join(f"{_cell(phase(r, kind), lost):>24}" for r in runs))
    lines.append(f"{'last step / checkpoints':{width}}" + "".join(
        f"{str(r['final_step']) + ' / ' + str(r['checkpoints']):>24}" for r in runs))
    start = result.get("load_avg_start", result["load_avg"])[0]
    load = f"1 min: {start:.1f} at the start, {result['load_avg'][0]:.1f} at the end"
    lines += ["", "recovery: from the signal to the first step of the new world; steps lost: last step "
              "of the old world minus the step resumed from"]
    if len(runs) > 1:
        lines += ["torchrun's tuning (keep-alive 1 s x 2) can evict live nodes, and its c10d store lives "
                  "on node-a:", "a crash of node-a ends that job (README: the MTTR table); elasticd keeps "
                  "the rendezvous in etcd"]
    lines += ["",
              f"demo took {result['total_s']:.0f} s (load average {load})",
              f"timeline picture: {result['png']}",
              f"summary:          {Path(result['png']).with_name('summary.json')}"]
    return "\n".join(lines)
