"""ElasticState and the world-size LR hooks, in one process (gloo, world of 1).

The LR hooks are checked against torch's own schedulers run on a twin optimizer
without hooks: the applied LR must be the scheduler's LR times the world factor at
every step, before and after a checkpoint round trip into another world, for
recursive schedulers too (no compounding).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elasticd.lab.chaos.faults import committed
from elasticd.lab.embedded_etcd import free_port
from tests.checkpointing.helpers import FaultyStorage
from tests.trainer.launch import EXAMPLES
from trainer import dist as tdist
from trainer.context import ElasticContext
from trainer.distributed_sampler import ElasticDistributedSampler
from trainer.elastic import ElasticState
from trainer.errors import ConfigError
from trainer.examples import regression
from trainer.lr import start_scale
from trainer.stop import STOP_SIGNALS
from trainer.worldlr import WorldLR

REPO = EXAMPLES.parents[1]

SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=17),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=60),
    "warmup-cosine": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, 0.1, 1.0, total_iters=5),
              torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)], milestones=[5]),
}


def _opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    opt.step()


class Counter:
    def __init__(self) -> None:
        self.step = 0


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_applied_lr_is_the_schedulers_times_the_world_factor_across_a_resume(kind):
    twin_model, twin = _opt()
    twin_sched = SCHEDULERS[kind](twin)
    model, opt = _opt()
    sched = SCHEDULERS[kind](opt)
    steps = Counter()
    scale = [start_scale(None, 0, 2, "linear")]  # base world 2: factor 1
    hooks = WorldLR(opt, lambda: scale[0], lambda: steps.step)
    applied, expected = [], []
    for s in range(40):
        if s == 10:  # the world shrinks to 1 mid-run: factor 0.5 from here
            scale[0] = start_scale(scale[0], s, 1, "linear")
        if s == 25:  # a resume into a world of 3 (factor 1.5) from a checkpoint of step 25
            saved_opt, saved_sched = opt.state_dict(), sched.state_dict()
            model, opt = _opt()
            sched = SCHEDULERS[kind](opt)
            opt.load_state_dict(saved_opt)
            sched.load_state_dict(saved_sched)
            hooks.remove()
            scale[0] = start_scale(scale[0], s, 3, "linear")
            hooks = WorldLR(opt, lambda: scale[0], lambda: steps.step)
        expected.append(twin.param_groups[0]["lr"] * scale[0].factor(s))
        _step(twin_model, twin)
        twin_sched.step()
        _step(model, opt)
        applied.append(hooks.applied[0])
        sched.step()
        steps.step += 1
        # Between steps the optimizer holds the scheduler's own (unscaled) LR.
        assert opt.param_groups[0]["lr"] == pytest.approx(twin.param_groups[0]["lr"], rel=1e-12)
    assert applied == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_a_step_that_raised_does_not_compound_the_factor():
    model, opt = _opt()
    scale = start_scale(None, 0, 1, "linear", base_world_size=2)  # factor 0.5
    hooks = WorldLR(opt, lambda: scale, lambda: 0)

    def boom(_opt, _args, _kwargs):
        raise RuntimeError("a step that fails after the pre-hook")

    handle = opt.register_step_pre_hook(boom)
    with pytest.raises(RuntimeError):
        _step(model, opt)
    handle.remove()
    assert hooks.updates == 0
    _step(model, opt)
    assert hooks.applied == [0.05] and opt.param_groups[0]["lr"] == 0.1 and hooks.updates == 1


def test_a_schedule_function_owns_the_unscaled_lr():
    model, opt = _opt()
    steps = Counter()
    scale = start_scale(None, 0, 4, "linear", base_world_size=2)  # factor 2
    hooks = WorldLR(opt, lambda: scale, lambda: steps.step, schedule=lambda s: 1 / (s + 1))
    opt.param_groups[0]["lr"] = 123.0  # a stale LR from a loaded state must not matter
    for s in range(3):
        _step(model, opt)
        assert hooks.applied == [pytest.approx(0.1 / (s + 1) * 2, rel=1e-15)]
        steps.step += 1


# -- ElasticState in a world of one ---------------------------------------------------------


@pytest.fixture
def world_of_one(monkeypatch, tmp_path):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    ctx = ElasticContext.single_process(master_port=port, checkpoint_dir=str(tmp_path / "ckpt"),
                                        checkpoint_every_steps=4, lr_base_world_size=2)
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    tdist.init_distributed(ctx)
    yield ctx
    tdist.shutdown()
    for sig, handler in handlers.items():  # ElasticState.start caught them in this process
        signal.signal(sig, handler)


ARGS = regression.arguments("test", ["--samples=40", "--batch-size=8", "--warmup-steps=3",
                                     "--cosine-steps=20", "--dtype=float64", "--lr=0.01"])


def _job(ctx: ElasticContext) -> tuple[ElasticState, DataLoader, ElasticDistributedSampler]:
    dataset = regression.make_dataset(ARGS)
    sampler = ElasticDistributedSampler(dataset, num_replicas=1, rank=0, seed=3)
    loader = DataLoader(dataset, batch_size=ARGS.batch_size, sampler=sampler)
    model = regression.make_model(ARGS)
    optimizer = torch.optim.Adam(model.parameters(), lr=ARGS.lr)
    scheduler = regression.warmup_cosine(optimizer, ARGS)
    # Agreeing after every step: the stop's step is then exact (the cadence: below).
    state = ElasticState(model, optimizer, loader=loader, scheduler=scheduler, ctx=ctx,
                         exit_on_stop=False, start=False, agree_interval_s=0)
    state.start()
    return state, loader, sampler


def _train(state: ElasticState, loader: DataLoader, sampler, epochs: int) -> list[float]:
    """The converted example's loop; returns the LRs applied. Stops when step_done says so."""
    return _train_with(state, state.state.model, loader, sampler, epochs)


def _train_with(state: ElasticState, model: torch.nn.Module, loader: DataLoader, sampler,
                epochs: int) -> list[float]:
    applied = []
    for epoch in range(state.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            state.state.optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            state.state.optimizer.step()
            applied.append(state.lr.applied[0])
            state.state.stateful["scheduler"].step()
            if state.step_done(loss):
                return applied
    return applied


def _formula(step: int, world: int) -> float:
    unscaled = ARGS.lr * regression.warmup_cosine_factor(step, ARGS.warmup_steps,
                                                         ARGS.cosine_steps, ARGS.warmup_start)
    return unscaled * world / 2  # linear rule, base world 2


def test_stop_is_agreed_one_step_later_and_a_resume_continues_the_schedule(world_of_one):
    state, loader, sampler = _job(world_of_one)
    assert state.step == 0 and state.epoch == 0
    first = _train(state, loader, sampler, epochs=1)  # 40 samples / 8 = 5 steps
    assert state.step == 5 and sampler.position == 40
    state.stop.request("test")
    stopped_at = None
    sampler.set_epoch(1)
    for x, y in loader:
        state.state.optimizer.zero_grad()
        torch.nn.functional.mse_loss(state.state.model(x), y).backward()
        state.state.optimizer.step()
        first.append(state.lr.applied[0])
        state.state.stateful["scheduler"].step()
        if state.step_done():
            stopped_at = state.step
            break
    # The request was posted with step 6 and read at step 7: the agreed stop follows step 7.
    assert stopped_at == 7 and state.checkpoints.latest_step() == 7
    assert first == pytest.approx([_formula(s, 1) for s in range(7)], rel=1e-12)
    state.close()

    resumed, loader, sampler = _job(world_of_one)
    assert (resumed.step, resumed.epoch, sampler.position) == (7, 1, 56)
    rest = _train(resumed, loader, sampler, epochs=3)
    assert rest == pytest.approx([_formula(s, 1) for s in range(7, 15)], rel=1e-12)
    assert sampler.position == 3 * 40 and resumed.finish() == 0


def test_the_agreement_cadence_fits_its_interval_to_the_agreed_step_time():
    assert tdist.agree_every(0, 250_000) == 1  # the step time is not known yet
    assert tdist.agree_every(50_000, 250_000) == 5
    assert tdist.agree_every(300_000, 250_000) == 1  # a step longer than the interval
    assert tdist.agree_every(50_000, 0) == 1  # interval 0: every step
    assert tdist.agree_every(1, 10**9) == tdist.MAX_AGREE_EVERY
    with pytest.raises(ConfigError, match="agree_interval_s=-1 must be >= 0"):
        tdist.Agreement(torch.device("cpu"), -1)


def test_the_agreement_posts_on_its_cadence_and_sees_a_stop_within_it(world_of_one):
    step = 0
    agreement = tdist.Agreement(torch.device("cpu"), 0.25, clock=lambda: 0.05 * step)
    seen = {}  # the step after which something was agreed -> what
    for step in range(1, 16):  # 50 ms steps on the injected clock: every 5th posts
        agreed = agreement.after_step(step, stop=step >= 8, loss_sum=2.0 * step, loss_divisor=4)
        if agreed is not None:
            seen[step] = agreed
    # Post after 1 (no step time yet: 1 step), after 2 (50 ms: 5 steps), 7, 12; each read
    # one step later. The stop asked from step 8 on rides the post after 12.
    assert sorted(seen) == [2, 3, 8, 13]
    assert [(a.step, a.stop, a.every) for a in seen.values()] == [
        (1, False, 1), (2, False, 5), (7, False, 5), (12, True, 5)]
    assert [a.loss for a in seen.values()] == [0.5, 1.0, 3.5, 6.0]
    assert agreement.result() is None  # nothing posted since (the next is after 17)


def test_the_agreement_sees_a_planned_change_once_every_rank_has_and_then_posts_nothing(
        world_of_one):
    """A join or drain is taken after the step the ranks agree on (every rank has seen the
    record: the sum of the flags is the rank count); no reduction is left in flight in the
    group about to be left."""
    agreement = tdist.Agreement(torch.device("cpu"), 0.0)
    seen = [agreement.after_step(step, False, 1.0, change=step >= 3) for step in range(1, 5)]
    assert [a.change if a else None for a in seen] == [None, False, False, True]
    assert agreement.result() is None  # the read after step 4 posted nothing


def test_run_without_the_in_place_mode_is_the_plain_loop_and_wants_the_bare_module(world_of_one):
    state, loader, sampler = _job(world_of_one)
    calls = []

    def train(model: torch.nn.Module) -> None:
        calls.append(model)
        _train_with(state, model, loader, sampler, epochs=2)

    assert state.run(train) == 0 and len(calls) == 1 and state.step == 10
    assert isinstance(calls[0], torch.nn.parallel.DistributedDataParallel)
    assert calls[0].module is state.state.model
    wrapped = ElasticState(torch.nn.parallel.DistributedDataParallel(regression.make_model(ARGS)),
                           state.state.optimizer, loader=loader, ctx=world_of_one, start=False)
    with pytest.raises(ConfigError, match="pass the module"):
        wrapped.run(train)


def test_a_failure_commits_the_last_step_only_while_the_weights_are_those_of_it(world_of_one):
    state, loader, sampler = _job(world_of_one)
    _train(state, loader, sampler, epochs=1)
    assert state.consistent()
    sampler.set_epoch(1)
    x, y = next(iter(loader))
    torch.nn.functional.mse_loss(state.state.model(x), y).backward()
    state.state.optimizer.step()  # the weights moved; step_done never came
    assert not state.consistent()
    assert state.fail(tdist.CollectiveError("peer gone")) == 1
    state.close()
    assert state.checkpoints.latest_step() == 4  # the periodic save, not a lie about step 5


def test_a_full_checkpoint_disk_skips_periodic_saves_and_training_goes_on(world_of_one):
    """Regression (the chaos suite's checkpoint-dir-full): a periodic save's ENOSPC was
    raised into the training loop at the next save and killed the worker."""
    state, loader, sampler = _job(world_of_one)   # a checkpoint every 4 steps
    full = FaultyStorage(state.checkpoints.directory)
    full.space_left = 0
    state.checkpoints.storage = full
    _train(state, loader, sampler, epochs=3)       # 15 steps: saves at 4 (fails), 8, 12
    assert state.step == 15 and state.checkpoints.latest_step() is None   # nothing committed
    full.space_left = None                         # space is back
    _train(state, loader, sampler, epochs=4)       # steps 16 and 20 commit
    state.checkpoints.wait()
    assert state.step == 20 and sorted(s for s, _ in committed(full.root)) == [16, 20]
    state.close()


def test_bad_loaders_are_refused_with_the_fix(world_of_one):
    dataset = TensorDataset(torch.zeros(8, 1))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 1, 0))
    with pytest.raises(ConfigError, match="sampler=ElasticDistributedSampler"):
        ElasticState(model, opt, loader=plain, ctx=world_of_one, start=False)
    unbatched = DataLoader(dataset, batch_size=None,
                           sampler=ElasticDistributedSampler(dataset, 1, 0))
    with pytest.raises(ConfigError, match="give the DataLoader a batch_size"):
        ElasticState(model, opt, loader=unbatched, ctx=world_of_one, start=False)


def test_the_formula_is_the_schedulers():
    """The closed form the process tests check against is torch's SequentialLR."""
    model, opt = _opt()
    sched = regression.warmup_cosine(opt, ARGS)
    for s in range(30):
        want = 0.1 * regression.warmup_cosine_factor(s, ARGS.warmup_steps, ARGS.cosine_steps,
                                                     ARGS.warmup_start)
        assert math.isclose(opt.param_groups[0]["lr"], want, rel_tol=1e-12, abs_tol=1e-15)
        _step(model, opt)
        sched.step()


def test_reseed_draws_what_torch_manual_seed_draws():
    from trainer.state import reseed

    torch.manual_seed(1234)
    want = torch.rand(5)
    torch.manual_seed(99)
    reseed(1234, torch.device("cpu"))
    assert torch.equal(torch.rand(5), want)


STARTING = """
import torch
from trainer.examples import mlp
from trainer.loop import ElasticTrainer, TrainConfig
x, y = mlp.make_data(8, 0, torch.float64)
model = mlp.make_model(torch.float64)
print("building", flush=True)
ElasticTrainer(model, mlp.make_optimizer(model, 0.1, 0.0), 8, lambda i: (x[i], y[i]),
               mlp.per_sample_loss, TrainConfig(micro_batch=2, max_steps=1)).run()
"""


@pytest.mark.process
def test_a_worker_still_joining_its_process_group_dies_of_sigterm_at_once(tmp_path):
    """Rank 1 of 2 whose rank 0 never comes: blocked in the store's connect (C++), where a
    Python handler never runs. torchrun's SIGTERM must end it, not its SIGKILL 30 s later."""
    env = dict(os.environ, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", STARTING], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "building"
        time.sleep(2.0)  # into init_process_group
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        print(f"died {time.monotonic() - sent:.2f} s after SIGTERM")
    finally:
        proc.kill()
        proc.wait()


def test_the_state_digest_is_equal_for_equal_states_and_sees_one_ulp():
    from trainer.state import TrainState

    model, opt = _opt()
    _step(model, opt)
    a = TrainState(model, opt, None, step=4)
    twin_model = torch.nn.Linear(3, 1)
    twin_model.load_state_dict(model.state_dict())
    twin_opt = torch.optim.SGD(twin_model.parameters(), lr=0.7, momentum=0.9)   # another LR
    twin_opt.load_state_dict(opt.state_dict())
    for group in twin_opt.param_groups:
        group["lr"] = 0.7   # re-applied after a hand-over: not part of the digest
    b = TrainState(twin_model, twin_opt, None, step=4)
    assert a.digest() == b.digest()
    assert a.digest() != TrainState(twin_model, twin_opt, None, step=5).digest()
    with torch.no_grad():
        w = twin_model.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(2.0))   # one ulp
    assert a.digest() != b.digest()
