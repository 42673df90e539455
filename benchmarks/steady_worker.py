"""The worker of ``benchmarks/steady_state.py``: one variant's step rate, or the pieces' costs.

    python -m torch.distributed.run --standalone --nproc-per-node=2 --monitor-interval=0.1 \\
        -m benchmarks.steady_worker --mode trainer --steps 2000 --warmup 200 --out R.json

Every mode trains the same thing: trainer/examples/mlp.py's model (10 -> 50 -> 1, float32),
its SGD (lr 0.05, momentum 0.9), 4096 samples, 16 per rank per step. Modes:

    bare         a plain DDP loop that indexes the tensors (what ElasticTrainer's batch_fn does)
    bare-loader  a plain DDP loop over DataLoader + torch's DistributedSampler
    dropin       that DataLoader loop with ElasticDistributedSampler + ElasticState.step_done
    trainer      ElasticTrainer over the same model, optimizer and batch_fn, as mlp.py builds it
    trainer-noreseed  the same with TrainConfig(reseed_each_step=False): the reseed's cost in place
    pieces       each per-step piece of the elastic loops timed alone (``PIECES``)

The clock is a forward pre-hook on the model, the one point every loop passes once per step
(ElasticTrainer's own loop is not touched): it stamps ``time.perf_counter()`` (and the
process's CPU time) and then sleeps ``--step-sleep`` s, the stand-in for a GPU step, in the
same place in every mode.
Rank 0 writes the result JSON; steps/s = timed steps / (stamp[warmup + steps] - stamp[warmup]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainer import dist as tdist
from trainer.batching import shard
from trainer.context import DEFAULT_LR_RULE, ElasticContext
from trainer.distributed_sampler import ElasticDistributedSampler
from trainer.elastic import ElasticState
from trainer.examples.mlp import make_data, make_model, make_optimizer, per_sample_loss
from trainer.exitcodes import exit_worker
from trainer.logs import configure_logging
from trainer.loop import ElasticTrainer, TrainConfig
from trainer.lr import start_scale
from trainer.progress import ProgressReporter
from trainer.sampler import ElasticSampler
from trainer.state import reseed, step_seed
from trainer.worldlr import WorldLR

MODES = ("bare", "bare-loader", "dropin", "trainer", "trainer-noreseed", "pieces")
SAMPLES, DATA_SEED, BATCH, LR, MOMENTUM, SEED = 4096, 1234, 16, 0.05, 0.9, 0
# Between two timed collectives: longer than a loopback all-reduce, as a step is, so the
# async agreement's reduction has finished when the next post reads it (its steady state).
COLLECTIVE_GAP_S = 0.002


class StepClock:
    """A forward pre-hook: a time stamp per step, then the step's stand-in sleep.

    With the wall clock it stamps the process's CPU time (all its threads, gloo's too): on
    a loaded machine a variant's wall time moves with its neighbours, its CPU time hardly.
    """

    def __init__(self, model: nn.Module, sleep_s: float) -> None:
        self.sleep_s = sleep_s
        self.stamps: list[float] = []
        self.cpu_stamps: list[float] = []
        model.register_forward_pre_hook(self._hook)

    def _hook(self, _module: nn.Module, _args: tuple) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        if self.sleep_s:
            time.sleep(self.sleep_s)

    def result(self, warmup: int, steps: int) -> dict[str, Any]:
        """steps/s over the timed window and the step-time distribution inside it."""
        window = self.stamps[warmup : warmup + steps + 1]
        if len(window) < steps + 1:
            raise RuntimeError(f"only {len(self.stamps)} steps ran; {warmup + steps + 1} needed")
        gaps_ms = sorted(1000 * (b - a) for a, b in zip(window, window[1:], strict=False))
        total = window[-1] - window[0]
        cpu = self.cpu_stamps[warmup + steps] - self.cpu_stamps[warmup]
        return {"steps": steps, "seconds": total, "steps_per_s": steps / total,
                "cpu_ms_per_step": 1000 * cpu / steps,
                "step_ms_mean": 1000 * total / steps, "step_ms_p50": statistics.median(gaps_ms),
                "step_ms_p90": gaps_ms[int(0.9 * (len(gaps_ms) - 1))], "step_ms_max": gaps_ms[-1]}


def workload() -> tuple[torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """mlp.py's data, model and optimizer (its defaults), seeded as mlp.py seeds them."""
    x, y = make_data(SAMPLES, DATA_SEED, torch.float32)
    torch.manual_seed(SEED)
    model = make_model(torch.float32)
    return x, y, model, make_optimizer(model, LR, MOMENTUM)


def mean_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return per_sample_loss(model, (x, y)).mean()


# -- the four loops ----------------------------------------------------------------------

def run_bare(total: int, sleep_s: float) -> StepClock:
    """A tutorial DDP loop over index slices of the tensors (no DataLoader)."""
    x, y, model, optimizer = workload()
    clock = StepClock(model, sleep_s)
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_epoch = SAMPLES // (BATCH * world)
    perm = np.arange(SAMPLES)
    for step in range(total):
        if step % per_epoch == 0:
            perm = np.random.default_rng([SEED, step // per_epoch]).permutation(SAMPLES)
        start = (step % per_epoch) * BATCH * world
        idx = perm[start : start + BATCH * world][rank::world]
        optimizer.zero_grad(set_to_none=True)
        mean_loss(ddp, x[idx], y[idx]).backward()
        optimizer.step()
    return clock


def loader_steps(loader: DataLoader, sampler: Any, total: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """``total`` batches of the usual epoch loop (``set_epoch`` at every epoch)."""
    done, epoch = 0, 0
    while done < total:
        sampler.set_epoch(epoch)
        for batch in loader:
            yield batch
            done += 1
            if done == total:
                return
        epoch += 1


def run_loader(total: int, sleep_s: float, elastic: bool) -> StepClock:
    """The DataLoader loop: torch's DistributedSampler, or the drop-in blocks (``elastic``)."""
    x, y, model, optimizer = workload()
    clock = StepClock(model, sleep_s)
    dist.init_process_group("gloo")
    ddp = DistributedDataParallel(model)
    dataset = TensorDataset(x, y)
    kind = ElasticDistributedSampler if elastic else DistributedSampler
    sampler = kind(dataset, shuffle=True, seed=SEED)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    state = ElasticState(ddp, optimizer, loader=loader) if elastic else None
    for xb, yb in loader_steps(loader, sampler, total):
        optimizer.zero_grad(set_to_none=True)
        loss = mean_loss(ddp, xb, yb)
        loss.backward()
        optimizer.step()
        if state is not None:
            state.step_done(loss)
    if state is not None:
        state.finish()
    return clock


def run_trainer(total: int, sleep_s: float, reseed: bool = True) -> StepClock:
    """ElasticTrainer as trainer/examples/mlp.py (common.train) builds it."""
    x, y, model, optimizer = workload()
    clock = StepClock(model, sleep_s)
    config = TrainConfig(micro_batch=BATCH, max_steps=total, seed=SEED, reseed_each_step=reseed)
    trainer = ElasticTrainer(model, optimizer, len(x), lambda idx: (x[idx], y[idx]),
                             per_sample_loss, config, ctx=ElasticContext.from_env())
    code = trainer.run()
    if code != 0:
        raise RuntimeError(f"ElasticTrainer.run() returned {code}")
    return clock


# -- the pieces --------------------------------------------------------------------------

def timed_calls(call: Callable[[int], Any], n: int, gap_s: float = 0.0) -> float:
    """Mean seconds per ``call(i)``; with ``gap_s``, each call timed alone, sleeping between."""
    if not gap_s:
        start = time.perf_counter()
        for i in range(n):
            call(i)
        return (time.perf_counter() - start) / n
    spent = 0.0
    for i in range(n):
        time.sleep(gap_s)
        start = time.perf_counter()
        call(i)
        spent += time.perf_counter() - start
    return spent / n


class Pieces:
    """Each piece: a description and ``run(n)`` -> mean seconds per step over ``n`` steps.

    ``ctx`` names the progress file (a temp file when it names none); the collective
    pieces and ``step_done`` need a process group (any world size, world 1 included).
    """

    def __init__(self, ctx: ElasticContext, progress_dir: str) -> None:
        self.ctx = ctx
        self.rank, self.world = ctx.rank, ctx.world_size
        self.progress_file = ctx.progress_file or os.path.join(progress_dir, "progress.json")
        self.fields = {"lr": LR, "loss": 0.25, "lrs": [LR], "epoch": 0,
                       "global_batch": BATCH * self.world, "position": 0}
        self.table: dict[str, tuple[str, Callable[[int], float]]] = {
            "step_boundary": ("the old blocking stop/loss all-reduce (dist.step_boundary), "
                              "a 2 ms step apart", self.step_boundary),
            "agreement_post": ("dist.Agreement posting after every step (agree_interval_s=0; "
                               "async, read a step later), a 2 ms step apart",
                               self.agreement(0.0, COLLECTIVE_GAP_S)),
            "agreement_cadenced": ("dist.Agreement at its default cadence (a post every "
                                   f"{tdist.AGREE_INTERVAL_S} s), a 2 ms step apart",
                                   self.agreement(tdist.AGREE_INTERVAL_S, COLLECTIVE_GAP_S)),
            "agreement_post_back_to_back": ("a post after every step with no step between (it "
                                            "waits for the whole reduction)",
                                            self.agreement(0.0, 0.0)),
            "progress_rate_limited": ("ProgressReporter.report('step'), file at most every "
                                      "0.25 s, no log line", self.progress(0.25)),
            "progress_every_step": ("report('step') rewriting the file every step "
                                    "(file_interval_s=0), no log line", self.progress(0.0)),
            "progress_log_line": ("report('step') with a structlog line every step, no file",
                                  self.log_line),
            "step_seed": ("trainer.state.step_seed (BLAKE2b)", self.seed(False)),
            "step_seed_reseed": ("step_seed + trainer.state.reseed (ElasticTrainer's per-step "
                                 "reseed)", self.seed(True)),
            "optimizer_step": ("optimizer.step() alone (SGD momentum, the MLP)",
                               self.optimizer_step(False)),
            "optimizer_step_worldlr": ("optimizer.step() with the WorldLR pre/post hooks",
                                       self.optimizer_step(True)),
            "dist_sampler_batch": ("a DataLoader batch over DistributedSampler",
                                   self.loader_batch(False)),
            "elastic_sampler_batch": ("a DataLoader batch over ElasticDistributedSampler "
                                      "+ advance(16)", self.loader_batch(True)),
            "bare_indices": ("the bare loop's indices + x[idx], y[idx]", self.indices(False)),
            "trainer_indices": ("ElasticSampler.next_indices + shard + advance + x[idx], y[idx]",
                                self.indices(True)),
            "step_done": ("ElasticState.step_done(loss) whole (agreement, progress, its line "
                          "every 10 steps), a 2 ms step apart", self.step_done),
        }

    # The collective pieces time each call alone with a step's gap before it.
    def step_boundary(self, n: int) -> float:
        return timed_calls(lambda i: tdist.step_boundary(False, 1.0, torch.device("cpu")), n,
                           COLLECTIVE_GAP_S)

    def agreement(self, interval_s: float, gap_s: float) -> Callable[[int], float]:
        def run(n: int) -> float:
            agreement = tdist.Agreement(torch.device("cpu"), interval_s)
            loss = torch.tensor(0.25)
            spent = timed_calls(lambda i: agreement.after_step(i + 1, False, loss), n, gap_s)
            agreement.result()  # no reduction left behind for the next piece's collectives
            return spent
        return run

    def progress(self, interval_s: float) -> Callable[[int], float]:
        def run(n: int) -> float:
            reporter = ProgressReporter(self.ctx_with_file(), log_every=10**9,
                                        file_interval_s=interval_s)
            return timed_calls(lambda i: reporter.report("step", i + 1, **self.fields), n)
        return run

    def log_line(self, n: int) -> float:
        reporter = ProgressReporter(self.ctx_with_file(), log_every=1)
        reporter.path = None  # the line alone
        return timed_calls(lambda i: reporter.report("step", i + 1, **self.fields), n)

    def ctx_with_file(self) -> ElasticContext:
        return self.ctx.with_overrides(progress_file=self.progress_file)

    def seed(self, generator: bool) -> Callable[[int], float]:
        def call(i: int) -> None:
            seed = step_seed(SEED, i, self.rank)
            if generator:
                reseed(seed, torch.device("cpu"))
        return lambda n: timed_calls(call, n)

    def optimizer_step(self, hooked: bool) -> Callable[[int], float]:
        def run(n: int) -> float:
            x, y, model, optimizer = workload()
            mean_loss(model, x[:BATCH], y[:BATCH]).backward()  # grads stay: each step is real
            if hooked:
                scale = start_scale(None, 0, self.world, DEFAULT_LR_RULE)
                WorldLR(optimizer, lambda: scale, lambda: 0)
            return timed_calls(lambda i: optimizer.step(), n)
        return run

    def loader_batch(self, elastic: bool) -> Callable[[int], float]:
        def run(n: int) -> float:
            x, y, _, _ = workload()
            dataset = TensorDataset(x, y)
            kind = ElasticDistributedSampler if elastic else DistributedSampler
            sampler = kind(dataset, num_replicas=self.world, rank=self.rank, shuffle=True,
                           seed=SEED)
            batches = loader_steps(DataLoader(dataset, batch_size=BATCH, sampler=sampler),
                                   sampler, n)

            def call(_i: int) -> None:
                xb, _ = next(batches)
                if elastic:
                    sampler.advance(len(xb))  # what step_done does per step
            return timed_calls(call, n)
        return run

    def indices(self, trainer: bool) -> Callable[[int], float]:
        def run(n: int) -> float:
            x, y, _, _ = workload()
            gb = BATCH * self.world
            sampler = ElasticSampler(SAMPLES, SEED)
            perm = np.random.default_rng([SEED, 0]).permutation(SAMPLES)

            def call(i: int) -> None:
                if trainer:
                    idx = shard(sampler.next_indices(gb), self.world, self.rank)
                    sampler.advance(gb)
                else:
                    start = (i % (SAMPLES // gb)) * gb
                    idx = perm[start : start + gb][self.rank :: self.world]
                _ = (x[idx], y[idx])
            return timed_calls(call, n)
        return run

    def step_done(self, n: int) -> float:
        _, _, model, optimizer = workload()
        x, y, _, _ = workload()
        dataset = TensorDataset(x, y)
        sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=SEED)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        state = ElasticState(model, optimizer, loader=loader, ctx=self.ctx_with_file())
        loss = torch.tensor(0.25)
        # Past the loader epoch's end the sampler advances by 0: the same work per call.
        spent = timed_calls(lambda i: state.step_done(loss), n, COLLECTIVE_GAP_S)
        state._settle()  # noqa: SLF001 - no reduction left behind for the next piece
        return spent

    def measure(self, names: Iterable[str], iterations: int, rounds: int,
                collective_iterations: int | None = None) -> dict[str, Any]:
        """Per piece: the median over ``rounds`` of the mean µs per step; rounds interleave
        the pieces (A B C, A B C, ...) so a burst of machine load hits them all alike."""
        names = list(names)
        unknown = [n for n in names if n not in self.table]
        if unknown:
            raise ValueError(f"unknown pieces {unknown}; choose from {sorted(self.table)}")
        samples: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(rounds):
            for name in names:
                n = iterations
                if collective_iterations and name in COLLECTIVE_PIECES:
                    n = collective_iterations
                if self.world > 1:
                    dist.barrier()  # both ranks enter each piece together
                samples[name].append(1e6 * self.table[name][1](n))
        return {name: {"us": statistics.median(values), "us_rounds": values,
                       "what": self.table[name][0]} for name, values in samples.items()}


# Timed with a 2 ms gap per call: fewer iterations keep their rounds short.
COLLECTIVE_PIECES = ("step_boundary", "agreement_post", "agreement_cadenced",
                     "agreement_post_back_to_back", "step_done")
PIECES = (
    "step_boundary", "agreement_post", "agreement_cadenced", "agreement_post_back_to_back",
    "progress_rate_limited",
    "progress_every_step", "progress_log_line", "step_seed", "step_seed_reseed",
    "optimizer_step", "optimizer_step_worldlr", "dist_sampler_batch", "elastic_sampler_batch",
    "bare_indices", "trainer_indices", "step_done")


# -- entry point -------------------------------------------------------------------------

def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--steps", type=int, default=2000, help="timed steps")
    p.add_argument("--warmup", type=int, default=200, help="untimed steps first")
    p.add_argument("--step-sleep", type=float, default=0.0, help="s slept inside each step")
    p.add_argument("--pieces", default=",".join(PIECES))
    p.add_argument("--iterations", type=int, default=2000, help="pieces: calls per round")
    p.add_argument("--collective-iterations", type=int, default=500,
                   help="pieces: calls per round of the collective pieces (2 ms apart)")
    p.add_argument("--rounds", type=int, default=5, help="pieces: interleaved rounds")
    p.add_argument("--out", required=True, help="result JSON (written by rank 0)")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """The mode's result (on rank 0; None elsewhere)."""
    torch.set_num_threads(1)
    configure_logging()
    total = args.warmup + args.steps + 1  # the stamp after the last timed step ends the window
    if args.mode == "pieces":
        ctx = ElasticContext.from_env()
        tdist.init_distributed(ctx, "gloo")
        with tempfile.TemporaryDirectory() as tmp:
            result: dict[str, Any] = {"pieces": Pieces(ctx, tmp).measure(
                args.pieces.split(","), args.iterations, args.rounds, args.collective_iterations)}
    else:
        runners = {"bare": lambda: run_bare(total, args.step_sleep),
                   "bare-loader": lambda: run_loader(total, args.step_sleep, elastic=False),
                   "dropin": lambda: run_loader(total, args.step_sleep, elastic=True),
                   "trainer": lambda: run_trainer(total, args.step_sleep),
                   "trainer-noreseed": lambda: run_trainer(total, args.step_sleep, reseed=False)}
        result = runners[args.mode]().result(args.warmup, args.steps)
        result["warmup"] = args.warmup
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    return {"mode": args.mode, "step_sleep_s": args.step_sleep,
            "world_size": int(os.environ.get("WORLD_SIZE", "1")), **result}


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    result = run(args)
    if result is not None:
        Path(args.out).write_text(json.dumps(result, indent=1))
    # os._exit: a gloo group's and DDP's destructors can hang at teardown (trainer.dist.shutdown).
    exit_worker(0)


if __name__ == "__main__":
    sys.exit(main())
