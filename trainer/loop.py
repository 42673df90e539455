"""The elastic training loop: resume, step, checkpoint, coordinated stop.

A script builds its model, optimizer and data, then hands them to ``ElasticTrainer``
and exits with what ``run()`` returns::

    trainer = ElasticTrainer(model, optimizer, len(data), batch_fn, loss_fn,
                             TrainConfig(micro_batch=32, max_steps=1000))
    exit_worker(trainer.run())   # os._exit after a flush: see exitcodes.exit_worker

One step (``step`` counts completed optimizer steps):

1. take the next ``global_batch`` indices of the epoch's permutation; this rank's
   share is split into ``accum`` micro-batches;
2. forward/backward each micro-batch (DDP syncs on the last), optimizer step with
   the LR rescaled to the world size, ramped and scheduled (``trainer.worldlr``);
3. ``ElasticState.end_step``: advance the sampler and the step (the state is now
   that of ``step + 1`` on every rank); a few times a second (``agree_interval_s``)
   post the stop flag and this step's loss sum in an asynchronous all-reduce, read
   one step later (``dist.Agreement``);
4. rank 0 saves periodically (non-blocking); on a stop agreed (within
   ``agree_interval_s`` plus a step of any rank's SIGTERM, SIGINT or stop file) it
   saves this step blocking, all ranks pass a barrier and exit with STOP_EXIT_CODE.

Steps 3-4 (and resume, reporting, the failure commit) are ``trainer.elastic``'s, the
same code a hand-written loop runs through ``ElasticState``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import structlog
import torch

from checkpointing.errors import StaleGenerationError
from trainer import dist as tdist
from trainer import inplace
from trainer.batching import BatchPlan, micro_batches, plan_batches, shard
from trainer.context import ElasticContext
from trainer.elastic import ElasticState, checkpoint_due
from trainer.errors import ConfigError, TrainingDiverged
from trainer.exitcodes import FAILURE_EXIT_CODE, STOP_EXIT_CODE
from trainer.fitness import NodeUnfit, PeerUnfit
from trainer.lr import Schedule
from trainer.recover import InPlace, enter_live
from trainer.sampler import ElasticSampler
from trainer.state import TrainState, reseed, step_seed

log = structlog.get_logger(__name__)

BatchFn = Callable[[np.ndarray], Any]
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass
class TrainConfig:
    """What the script decides; the checkpoint cadence and LR policy come from the context.

    micro_batch: samples per rank per micro-step. global_batch: set it for
    constant-global-batch mode (gradient accumulation; the LR rule is then
    ignored: the global batch never changes). The run completes at ``max_steps``
    optimizer steps or after ``max_epochs`` epochs, whichever comes first.
    agree_interval_s: how often at most the ranks agree on a stop and the loss (0:
    after every step; see ``dist.Agreement``).
    """

    micro_batch: int
    max_steps: int | None = None
    max_epochs: int | None = None
    global_batch: int | None = None
    seed: int = 0
    shuffle: bool = True
    log_every: int = 10
    step_sleep_s: float = 0.0
    reseed_each_step: bool = True
    save_on_failure: bool = True
    agree_interval_s: float = tdist.AGREE_INTERVAL_S
    backend: str = "auto"
    timeout: timedelta = tdist.DEFAULT_TIMEOUT
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_steps is None and self.max_epochs is None:
            raise ConfigError("set max_steps or max_epochs: the run needs an end to complete")
        if self.step_sleep_s < 0:
            raise ConfigError(f"step_sleep_s={self.step_sleep_s} must be >= 0")


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (in nested tuples, lists and dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def dataset_batch_fn(dataset: Any, collate_fn: Callable[[list], Any] | None = None) -> BatchFn:
    """A ``batch_fn`` for any map-style dataset: ``collate_fn([dataset[i] for i in indices])``."""
    from torch.utils.data import default_collate

    collate = collate_fn or default_collate
    return lambda indices: collate([dataset[int(i)] for i in indices])


class ElasticTrainer:
    """Runs the loop described in the module docstring; one instance per worker process.

    ``batch_fn(indices)`` returns the batch for an array of dataset indices (this
    rank's micro-batch; ``dataset_batch_fn`` adapts a map-style Dataset); its tensors
    are moved to the worker's device. ``loss_fn(model, batch)`` returns *per-sample* losses
    (``reduction="none"``; extra dims are averaged per sample): the loop forms the
    mean over the step's global batch itself, exactly, whatever the split.
    ``lr_schedule(step)`` is an optional multiplier of the configured LRs.

    Resume, checkpoints, the stop agreement and the LR rescale are ``ElasticState``'s
    (trainer.elastic), the same implementation a hand-written loop uses; this class
    adds the batch plan, the exact global-batch loss and the in-place re-form.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset_len: int,
        batch_fn: BatchFn,
        loss_fn: LossFn,
        config: TrainConfig,
        ctx: ElasticContext | None = None,
        lr_schedule: Schedule | None = None,
    ) -> None:
        ctx = ctx or ElasticContext.from_env()
        self.config = config
        self.batch_fn = batch_fn
        self.loss_fn = loss_fn
        self.plan: BatchPlan = plan_batches(ctx.world_size, config.micro_batch,
                                            config.global_batch)
        # The configured LRs times the schedule are the unscaled LRs of every step: a
        # stale LR in a loaded optimizer state can never undo (or compound) the rescale.
        self.es = ElasticState(
            model, optimizer, sampler=ElasticSampler(dataset_len, config.seed, config.shuffle),
            ctx=ctx, log_every=config.log_every, exit_on_stop=False, start=False,
            lr_schedule=lr_schedule or _constant, agree_interval_s=config.agree_interval_s)
        self.es.state.global_batch = self.plan.global_batch
        if config.global_batch is not None:
            self.es.lr_rule = "none"  # constant global batch: the LR never changes either
        self.es.progress.publish_generation = True  # this loop re-forms in place
        self.device = torch.device("cpu")
        self.recovery = InPlace(self.es, config.timeout, config.ddp_kwargs,
                                on_world=self._replan)
        self.ddp: torch.nn.Module = model

    @property
    def ctx(self) -> ElasticContext:
        return self.es.ctx

    @property
    def state(self) -> TrainState:
        return self.es.state

    # -- lifecycle -----------------------------------------------------------------------

    def run(self) -> int:
        """Train until complete (returns 0), stopped (STOP_EXIT_CODE, 75), failed (1),
        diverged (DIVERGED_EXIT_CODE, 65) or unfit to resume (UNFIT_EXIT_CODE, 78)."""
        self.es.supervise()
        code = FAILURE_EXIT_CODE
        try:
            self._setup()
            code = self._train_recovering()
        except tdist.CollectiveError as exc:
            code = self._on_failure(exc)
        except (StaleGenerationError, TrainingDiverged, NodeUnfit, PeerUnfit) as exc:
            code = self.es.fail(exc)
        finally:
            if self._close() is not None and code != FAILURE_EXIT_CODE:
                code = FAILURE_EXIT_CODE  # its last save was refused: not a clean end
        log.info("worker exit", exit_code=code, step=self.state.step, rank=self.ctx.rank)
        return code

    def _setup(self) -> None:
        if self.ctx.joining:  # a newcomer: the group and the state of a live world
            self.device = enter_live(self.es, self.config.backend, self.config.timeout,
                                     on_world=self._replan)
        else:
            self.device = tdist.init_distributed(self.ctx, self.config.backend,
                                                 self.config.timeout)
        self.state.model.to(self.device)
        self.recovery.install_guard()
        self.es.start(self.device)  # the stop signals are caught from here (see start)
        self.ddp = self.recovery.wrap(self.state.model, reformed=self.es.entered_live)

    def _close(self) -> StaleGenerationError | None:
        """Finish the in-flight save; returns its StaleGenerationError if it was refused."""
        # The stop handlers stay installed until the process exits: restoring the default
        # SIGTERM action here let the agent's SIGTERM (sent once a peer died) kill the
        # worker before it logged its exit code (seen under load in CI).
        stale = self.es.close()
        tdist.shutdown(self.ddp)
        return stale

    def _on_failure(self, exc: tdist.CollectiveError) -> int:
        if not self.config.save_on_failure:
            log.error("collective failed; exiting for a restart", step=self.state.step,
                      error=str(exc))
            return FAILURE_EXIT_CODE
        # The state is consistent at every point a collective can fail (see ElasticState.
        # fail), so rank 0 can keep the steps done since the last periodic checkpoint.
        return self.es.fail(exc)

    # -- in-place recovery (trainer.recover) ----------------------------------------------

    def _train_recovering(self) -> int:
        """Train; in in-place mode a failed collective re-forms the group and training goes on."""
        while True:
            try:
                return self._train()
            except (tdist.CollectiveError, inplace.MembershipChange) as exc:
                ddp = self.recovery.recover(exc, self.ddp)
                if ddp is None:
                    raise
                self.ddp = ddp
            self.recovery.release_old()

    def _replan(self) -> None:
        """The batch plan of the world just adopted (``InPlace.on_world``)."""
        self.plan = plan_batches(self.ctx.world_size, self.config.micro_batch,
                                 self.config.global_batch)
        self.state.global_batch = self.plan.global_batch

    # -- training ------------------------------------------------------------------------

    def _train(self) -> int:
        while not self._complete():
            n, loss_sum = self._step()
            if self.es.end_step(loss_sum, n, samples=n, last=self._complete):
                return STOP_EXIT_CODE  # agreed, committed, every rank past the barrier
            if self.config.step_sleep_s:
                time.sleep(self.config.step_sleep_s)
        return self.es.finish(log_exit=False)

    def _complete(self) -> bool:
        cfg, st = self.config, self.state
        return (cfg.max_steps is not None and st.step >= cfg.max_steps) or (
            cfg.max_epochs is not None and st.sampler.epoch >= cfg.max_epochs
        )

    def _step(self) -> tuple[int, torch.Tensor | float]:
        """One optimizer step; returns (global sample count, this rank's loss sum).

        ``ElasticState.end_step`` then advances the sampler and the step: from there the
        state is that of ``step + 1`` on every rank (the gradient all-reduce succeeded),
        which is what makes a checkpoint after a later failure consistent.
        """
        st, ctx = self.state, self.ctx
        indices = st.sampler.next_indices(self.plan.global_batch)
        mine = shard(indices, ctx.world_size, ctx.rank)
        if self.config.reseed_each_step:
            reseed(step_seed(self.config.seed, st.step, ctx.rank), self.device)
        st.optimizer.zero_grad(set_to_none=True)
        loss_sum = self._accumulate(micro_batches(mine, self.plan.accum), len(indices), indices[0])
        st.optimizer.step()
        return len(indices), loss_sum

    def _accumulate(self, micro: Sequence[np.ndarray], n_global: int,
                    filler: int) -> torch.Tensor | float:
        """Backward of every micro-batch; DDP all-reduces on the last one only.

        The loss sum stays a tensor: reading it (``float``) would make the host wait for
        the device every step; the agreement reads it only on the steps it posts."""
        # DDP averages over ranks, so sum * world_size / n_global is the global mean.
        weight = self.ctx.world_size / n_global
        loss_sum: torch.Tensor | float = 0.0
        for i, batch_idx in enumerate(micro):
            last = i == len(micro) - 1
            if len(batch_idx) == 0 and not last:
                continue
            sync = contextlib.nullcontext() if last else self.ddp.no_sync()
            backward = tdist.synced_backward if last else torch.Tensor.backward
            with sync:
                if len(batch_idx):
                    losses = self._losses(batch_idx)
                    backward(losses.sum() * weight)
                    loss_sum = losses.detach().sum() + loss_sum
                else:
                    # An empty share at epoch end must still join the all-reduce: a real
                    # forward (DDP requires one) whose loss is multiplied by zero.
                    backward(self._losses(np.array([filler])).sum() * 0.0)
        return loss_sum

    def _losses(self, batch_idx: np.ndarray) -> torch.Tensor:
        batch = to_device(self.batch_fn(batch_idx), self.device)
        losses = self.loss_fn(self.ddp, batch)
        if losses.dim() == 0:
            raise ConfigError(
                "loss_fn returned a scalar; return per-sample losses (e.g. "
                "F.mse_loss(..., reduction='none')) so the loop can average over the global batch"
            )
        return losses.flatten(1).mean(1) if losses.dim() > 1 else losses


def _constant(_step: int) -> float:
    return 1.0


__all__ = ["BatchFn", "ElasticTrainer", "LossFn", "TrainConfig", "checkpoint_due",
           "dataset_batch_fn", "to_device"]
