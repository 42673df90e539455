"""``ElasticState``: resume, checkpoints, coordinated stop and the LR rescale for any loop.

The one implementation of those four, used by a hand-written loop directly and by
``ElasticTrainer`` (trainer.loop) underneath. A hand-written DDP loop keeps its shape::

    sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, num_workers=2)
    state = ElasticState(ddp_model, optimizer, loader=loader, scheduler=scheduler)
    for epoch in range(state.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...; loss.backward(); optimizer.step(); scheduler.step()
            state.step_done(loss)
    exit_worker(state.finish())

Construction resumes: rank 0 picks the newest checkpoint that verifies, every rank
loads it (model, optimizer, sampler, scheduler, grad scaler, registered extras) and
the world-size LR rescale is set for this world (``trainer.worldlr``). ``step_done``
counts the step, moves the sampler past the step's samples, agrees on stopping
without a blocking collective (``dist.Agreement``: a few times a second, each read one
step after its post, so a stop is seen within ``agree_interval_s`` plus a step), saves on the
checkpoint cadence (rank 0, in the background) and reports progress. On an agreed
stop (SIGTERM, SIGINT, the daemon's stop file) it commits the step, waits for every
rank and exits the process with ``STOP_EXIT_CODE``: the loop never sees it.
An uncaught exception ends the worker through ``exit_worker`` (after rank 0 commits
the last completed step, when the failure was a peer's): interpreter teardown after
a peer died can hang in torch's destructors.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import structlog
import torch

from checkpointing.errors import StaleGenerationError, StorageFullError
from elasticd.contract.generation import GenerationRecord
from trainer import dist as tdist
from trainer import inplace
from trainer.context import ElasticContext
from trainer.divergence import DivergenceCheck
from trainer.errors import ConfigError, TrainingDiverged
from trainer.exitcodes import (
    COMPLETE_EXIT_CODE,
    DIVERGED_EXIT_CODE,
    FAILURE_EXIT_CODE,
    STOP_EXIT_CODE,
    UNFIT_EXIT_CODE,
    exit_worker,
)
from trainer.fitness import NONE, Fitness, NodeUnfit, PeerUnfit
from trainer.logs import configure_logging
from trainer.lr import LRScale, Schedule, start_scale
from trainer.nonfinite import FirstBad, Suspects, attribute, position, sampler_span, weights_finite
from trainer.progress import ProgressReporter
from trainer.recover import InPlace, enter_live
from trainer.state import Stateful, TrainState
from trainer.stop import StopRequest
from trainer.watchdog import OrphanWatchdog
from trainer.worldlr import WorldLR

log = structlog.get_logger(__name__)


def checkpoint_due(
    step: int, since_last_s: float, every_steps: int | None, every_s: float | None
) -> bool:
    """Whether rank 0 saves after ``step``: every N steps and/or every T seconds.

    Rank 0 decides alone (only it writes), so a time-based cadence needs no agreement.
    """
    by_steps = every_steps is not None and step % every_steps == 0
    by_time = every_s is not None and since_last_s >= every_s
    return by_steps or by_time


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` a checkpoint holds (DDP's ``.module``)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class ElasticState:
    """See the module docstring. One instance per worker process.

    ``loader``: a ``DataLoader`` over an ``ElasticDistributedSampler`` with a
    ``batch_size`` (each step consumes one batch per rank). Or pass ``sampler`` and
    give ``step_done(samples=...)`` the samples this rank used. ``extra``: any other
    objects with ``state_dict``/``load_state_dict`` to checkpoint, by name.
    ``lr_schedule(step)``: instead of a torch scheduler, a multiplier of the LRs the
    optimizer was built with. ``start=False`` defers ``supervise`` and ``start`` to the
    caller (ElasticTrainer). ``agree_interval_s``: how often at most the ranks agree on a
    stop and the loss (``dist.Agreement``; 0: after every step); a stop is seen within
    it plus one step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        loader: Any = None,
        sampler: Any = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        extra: Mapping[str, Stateful] | None = None,
        ctx: ElasticContext | None = None,
        log_every: int = 10,
        exit_on_stop: bool = True,
        start: bool = True,
        lr_schedule: Schedule | None = None,
        agree_interval_s: float = tdist.AGREE_INTERVAL_S,
    ) -> None:
        if not structlog.is_configured():
            configure_logging()  # the progress lines are the contract's JSON lines
        self.ctx = ctx or ElasticContext.from_env()
        self.batch_size = _batch_size(loader)
        sampler = _sampler_of(loader, sampler)
        stateful = {"scheduler": scheduler, "scaler": scaler,
                    **{f"extra.{name}": obj for name, obj in (extra or {}).items()}}
        self._wrapped = model is not unwrap(model)
        self.state = TrainState(model=unwrap(model), optimizer=optimizer, sampler=sampler,
                                world_size=self.ctx.world_size,
                                global_batch=(self.batch_size or 0) * self.ctx.world_size,
                                stateful={k: v for k, v in stateful.items() if v is not None})
        self.lr_rule = self.ctx.lr_rule
        self.lr = WorldLR(optimizer, self._scale, lambda: self.state.step, lr_schedule)
        self.stop = StopRequest(self.ctx.stop_file)
        self.progress = ProgressReporter(self.ctx, log_every)
        self.progress.publish_generation = False  # set by a loop that re-forms in place
        self.watchdog = OrphanWatchdog(self.ctx.daemon_pid)
        self.exit_on_stop = exit_on_stop
        self.device = torch.device("cpu")
        self.agreement: tdist.Agreement | None = None
        self.agree_interval_s = agree_interval_s
        self.checkpoints: Any = None  # checkpointing.CheckpointManager when a dir is set
        self.saved_step = -1
        self.reported_step = -1
        self.loss: float | None = None  # the global mean loss of step ``loss_step``
        self.loss_step: int | None = None  # (the last agreed: see dist.Agreement)
        self.divergence = DivergenceCheck(self.ctx.nonfinite_loss_limit)
        self.first_bad = FirstBad()  # whose loss went non-finite first (trainer.nonfinite)
        self.suspects = Suspects(f"{self.ctx.progress_file}.nonfinite"
                                 if self.ctx.progress_file else None)
        self._updates_at_done = 0
        self._last_save = time.monotonic()
        self._closed = False
        self._stale: StaleGenerationError | None = None
        self._watch: inplace.GenerationWatch | None = None  # the planned-change watch
        self.entered_live = False  # a newcomer that took its state from a live peer
        if start:
            self.supervise()
            self.start()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch to (re)start the loop at: the sampler's, after a resume."""
        return int(getattr(self.state.sampler, "epoch", 0))

    @property
    def step(self) -> int:
        """Completed optimizer steps (restored on resume)."""
        return self.state.step

    def supervise(self) -> None:
        """The orphan watchdog and the uncaught-exception exit; the stop signals once the
        process group is up (``start``)."""
        self.watchdog.start()
        previous = sys.excepthook

        def on_uncaught(kind, exc, tb) -> None:  # noqa: ANN001 - sys.excepthook's signature
            previous(kind, exc, tb)
            code = self.fail(exc)
            self.close()
            self._exit(code)

        sys.excepthook = on_uncaught

    def start(self, device: torch.device | None = None) -> None:
        """Join the process group (if the script has not), catch the stop signals, open
        checkpoints, resume."""
        if device is None and self.ctx.joining and not self.entered_live:
            device = enter_live(self, on_world=self._reshard)
        self.device = device or tdist.init_distributed(self.ctx)
        # Only now: a worker blocked in the process group's connect (C++, so a Python
        # handler never runs) must die of SIGTERM at once, not 30 s later by torchrun's
        # SIGKILL (seen by the chaos suite); before the first step there is nothing to
        # commit anyway.
        self.stop.install()
        self.agreement = tdist.Agreement(self.device, self.agree_interval_s)
        self.open_checkpoints()
        if self.entered_live:
            self._updates_at_done = self.lr.updates  # the state came from a live peer
        else:
            self.resume()

    def open_checkpoints(self) -> None:
        directory = self.ctx.checkpoint_dir
        if directory is None:
            log.warning("no checkpoint directory: a stop or failure loses all progress",
                        hint="set ELASTICD_CHECKPOINT_DIR or --checkpoint-dir")
            return
        from checkpointing import CheckpointManager  # only when checkpoints are used

        # One writer: rank 0. The others only load, and must not clean up rank 0's files.
        # Rank 0 of generation g raises the directory's fence to g here (after the process
        # group is up) and its commits are refused once a newer world raises it further.
        self.checkpoints = CheckpointManager(directory, keep_last=self.ctx.keep_last,
                                             read_only=not self.ctx.is_rank0,
                                             generation=self.ctx.generation,
                                             generation_epoch=self.ctx.generation_epoch,
                                             generation_seq=self.ctx.generation_seq)

    def resume(self) -> None:
        """All ranks load the step rank 0 chose, then set the LR rescale for this world.

        First every node must see the job's newest checkpoint (``trainer.fitness``: one
        that cannot is charged with it, ``NodeUnfit``; the others exit ``PeerUnfit``)."""
        fitness = Fitness(self.ctx.node_first_rank, self.device,
                          self.ctx.checkpoint_dir, self._newest_seen, tdist.collective)
        newest = fitness.agree_newest()
        # Rank 0 picks the newest checkpoint that verifies (falling back past damaged
        # ones) and broadcasts its step, so every rank loads the same one.
        found = None
        if self.checkpoints is not None and self.ctx.is_rank0 and newest != NONE:
            found = self.checkpoints.load_latest()
        step = tdist.broadcast_int(found.step if found else -1, self.device)
        saved_scale: LRScale | None = None
        saved_world = None
        if step >= 0:
            found = self._load_agreed(step, found, fitness)
            saved_scale = self.state.load_checkpoint(found.state, step)
            saved_world = found.state["world"]["world_size"]
            self.saved_step = step
        self.rescale(saved_scale)
        self._updates_at_done = self.lr.updates
        if step >= 0:
            lrs = self.lr.preview()  # the LR of the next update, in this world
            self.progress.report("resumed", step, lr=lrs[0], lrs=lrs, from_world_size=saved_world,
                                 epoch=self.epoch, global_batch=self.state.global_batch,
                                 **self._position())

    def _newest_seen(self) -> int:
        """The newest step this rank's checkpoint directory shows committed (NONE: none)."""
        step = self.checkpoints.latest_step() if self.checkpoints is not None else None
        return NONE if step is None else step

    def _load_agreed(self, step: int, found: Any, fitness: Fitness) -> Any:
        """Checkpoint ``step`` (rank 0 chose it and holds it as ``found``), once every
        rank's load is judged (a collective: every rank comes here)."""
        from checkpointing.errors import CheckpointError  # only when checkpoints are used

        error = None
        if found is None:
            try:
                found = self.checkpoints.load(step)
            except (CheckpointError, OSError) as exc:  # missing here, or unreadable here
                error = exc
        fitness.judge_loads(step, error)
        return found

    def rescale(self, saved: LRScale | None) -> None:
        """The LR factor for this world, from the one in force before (None: a fresh start)."""
        self.state.scale = start_scale(saved, self.state.step, self.ctx.world_size, self.lr_rule,
                                       self.ctx.lr_base_world_size, self.ctx.lr_warmup_steps)

    def _scale(self) -> LRScale:
        if self.state.scale is None:
            raise ConfigError("optimizer.step() before ElasticState started: construct "
                              "ElasticState (it resumes) before the training loop")
        return self.state.scale

    # -- the step ------------------------------------------------------------------------

    def step_done(self, loss: torch.Tensor | float | None = None, *, batches: int = 1,
                  samples: int | None = None) -> bool:
        """Call once after each ``optimizer.step()``; ``loss``: this rank's mean loss.

        ``batches``: loader batches this step consumed (gradient accumulation); or
        ``samples``: the samples this rank consumed, for a loop without ``loader=``.
        Returns False. On an agreed stop it does not return (see the module docstring)
        unless ``exit_on_stop=False``, when it returns True after the stop commit.
        """
        if samples is None and self.batch_size is not None:
            samples = min(self.batch_size * batches, self.state.sampler.remaining)
        return self.end_step(loss, float(self.ctx.world_size), samples)

    def end_step(self, loss_sum: torch.Tensor | float | None, loss_divisor: float,
                 samples: int | None = None, last: Callable[[], bool] | None = None) -> bool:
        """``step_done`` for a loop that knows more: ``loss_sum`` / ``loss_divisor`` summed
        over ranks is the step's loss; ``last()``, asked once the step is counted: the run
        ends here (a stop agreed now is a completion)."""
        st = self.state
        before = position(st.sampler)
        self._advance_sampler(samples)
        st.step += 1
        self.first_bad.note(st.step, loss_sum, sampler_span(st.sampler, before))
        st.lrs_used = self.lr.applied
        # From here the state is that of the new step on every rank: a failure in a later
        # collective may commit it (see fail()).
        self._updates_at_done = self.lr.updates
        assert self.agreement is not None, "start() first"
        agreed = self.agreement.after_step(st.step, self.stop.requested(), loss_sum,
                                           loss_divisor, change=self.planned() is not None)
        self._take(agreed)
        if agreed is not None and agreed.stop and not (last and last()):
            self.report("step")  # every step done gets its line; "stopped" follows
            code = self.stop_now()
            if self.exit_on_stop:
                self.close()
                self._exit(code)
            return True
        if agreed is not None and agreed.change and not (last and last()):
            self.report("step")
            self._take_change()
        saved = self.periodic_checkpoint()
        self.report("checkpoint" if saved else "step")
        return False

    def planned(self) -> GenerationRecord | None:
        """The planned membership change (a join, a drain) in this worker's generation
        file, when its loop can take it in place (``run`` or ``ElasticTrainer``); else None."""
        if not (self.ctx.in_place and self.progress.publish_generation):
            return None
        gid = self.ctx.generation_id
        assert self.ctx.generation_file is not None and gid is not None  # ctx.in_place says so
        if self._watch is None or self._watch.mine != gid:
            self._watch = inplace.GenerationWatch(self.ctx.generation_file, gid)
        record = self._watch.newer()
        return record if record is not None and record.planned else None

    def _take_change(self) -> None:
        """Every rank saw a planned change after this step: leave the loop for the re-form
        (``MembershipChange``), or, where the new generation does not name this node (a
        drain), commit the step if this is rank 0 and exit as stopped."""
        record = self.planned()
        if record is None:
            return  # superseded by a loss's record since: the guard releases for that one
        if record.rank_of(self.ctx.node_id or "", self.ctx.local_rank) is not None:
            raise inplace.MembershipChange(record)
        log.info(f"generation {record.id} leaves this node out ({record.cause or 'planned'}); "
                 f"stopping after step {self.state.step}")
        # The survivors hold the same state; a commit the new world's fence refuses is
        # theirs to make, not lost.
        with contextlib.suppress(StaleGenerationError):
            self.commit_final("drain")
        self.report("stopped", stop_reason="left")
        self.close()
        self._exit(STOP_EXIT_CODE)

    def _advance_sampler(self, samples: int | None) -> None:
        if samples is not None:
            self.state.sampler.advance(samples)

    # -- in-place recovery for a hand-written loop (trainer.recover) ----------------------

    def run(self, train: Callable[[torch.nn.Module], object], **ddp_kwargs: Any) -> int:
        """Run ``train(model)`` to its end, re-forming the group in place after a lost peer.

        ``model`` is the model wrapped in DDP over the current group, its collectives
        guarded (``trainer.recover``): ``train`` uses it, not a DDP wrapper of its own,
        and starts its epochs at ``state.epoch``. After a re-form ``train`` is called again
        with the new group's model; the sampler continues at its position in the new
        world, so the step in flight is redone there. Returns ``finish()``'s exit code.
        A failure that cannot be recovered in place propagates (``supervise``'s hook then
        commits what can be, and the process exits for the restart path). Without the
        in-place mode (no daemon, or ``[recovery] mode = "restart"``) it is the plain loop.
        ``ddp_kwargs`` go to ``DistributedDataParallel``.
        """
        if self._wrapped:
            raise ConfigError("ElasticState.run wraps the model in DDP itself: pass the module "
                              "(not a DistributedDataParallel) to ElasticState")
        recovery = InPlace(self, tdist.DEFAULT_TIMEOUT, ddp_kwargs, on_world=self._reshard)
        self.progress.publish_generation = self.ctx.in_place  # the daemons may re-form it
        recovery.install_guard()
        model = recovery.wrap(self.state.model, reformed=self.entered_live)
        while True:
            try:
                train(model)
            except Exception as exc:
                collective = (isinstance(exc, inplace.MembershipChange)
                              or tdist.is_collective_failure(exc) or tdist.guard_released())
                reformed = recovery.recover(exc, model) if collective else None
                if reformed is None:
                    raise
                model = reformed
            else:
                return self.finish()
            recovery.release_old()

    def _reshard(self) -> None:
        """The sampler's layout and the global batch of the world just adopted."""
        reshard = getattr(self.state.sampler, "reshard", None)
        if reshard is not None:
            reshard(self.ctx.world_size, self.ctx.rank)
        self.state.global_batch = (self.batch_size or 0) * self.ctx.world_size

    # -- checkpoints and endings ---------------------------------------------------------

    def periodic_checkpoint(self) -> bool:
        if self.checkpoints is None or not self.ctx.is_rank0 or self.divergence.count:
            # (While the agreed loss is not finite no checkpoint is taken: a later resume
            # would load the diverged weights.)
            return False
        due = checkpoint_due(self.state.step, time.monotonic() - self._last_save,
                             self.ctx.checkpoint_every_steps, self.ctx.checkpoint_every_s)
        if due:
            try:
                self.save("periodic", blocking=False)
            except StorageFullError as exc:
                # A full checkpoint disk is no reason to stop training: the committed
                # checkpoints are intact, and a restarted worker could not even start
                # (its fence write fails too). Found by the chaos suite: the raise killed
                # the worker, 40 steps were redone. save() raised the earlier write's
                # failure and took nothing: take this step now (while the disk is still
                # full its write fails too, and that is raised, and skipped, at the next).
                log.warning("periodic checkpoint failed: checkpoint storage full; training on",
                            step=self.state.step, error=str(exc))
                self.save("periodic", blocking=False)
        return due

    def save(self, reason: str, blocking: bool) -> None:
        st = self.state
        if not weights_finite(st.model):
            # A NaN (this rank's or, through the gradients, a peer's) reached the weights
            # before the ranks agreed on it: a resume must load the last good checkpoint.
            log.error("not saving: the weights are not finite", step=st.step, reason=reason)
            return
        meta = {"reason": reason, "world_size": st.world_size, "loss": self.loss,
                "lr": (st.lrs_used or self.lr.unscaled())[0], "run_id": self.ctx.run_id,
                "restart_count": self.ctx.restart_count}
        self.checkpoints.save(st.step, st.to_checkpoint(), blocking=blocking, metadata=meta)
        self.saved_step = st.step
        self._last_save = time.monotonic()
        log.info("checkpoint saved" if blocking else "checkpoint started", step=st.step,
                 reason=reason, blocking=blocking)

    def commit_final(self, reason: str) -> None:
        """Rank 0 commits the current step (blocking) unless it is saved already."""
        if self.checkpoints is None or not self.ctx.is_rank0:
            return
        if self.saved_step == self.state.step:
            self.checkpoints.wait()  # it may still be writing in the background
        else:
            self.save(reason, blocking=True)

    def stop_now(self) -> int:
        """The agreed stop: rank 0 commits this step, every rank waits for it; the exit code."""
        log.info("coordinated stop", step=self.state.step, reason=self.stop.reason or "a peer")
        self._settle()
        self.commit_final("stop")
        # Nobody exits before rank 0 has committed: torchrun stops the whole group as
        # soon as one worker exits non-zero.
        tdist.barrier()
        self.report("stopped", stop_reason=self.stop.reason or "peer")
        return STOP_EXIT_CODE

    def finish(self, *, log_exit: bool = True) -> int:
        """The loop is done: commit the final step, wait for every rank; 0 (complete).

        For a hand-written loop: ``exit_worker(state.finish())``. ``log_exit=False``: the
        caller logs the worker's exit itself (ElasticTrainer.run)."""
        self._settle()
        self.commit_final("complete")
        tdist.barrier()
        self.report("completed")
        # A refused last save is not a clean end.
        code = FAILURE_EXIT_CODE if self.close() is not None else COMPLETE_EXIT_CODE
        if log_exit:
            self._log_exit(code)
        return code

    def _log_exit(self, code: int) -> None:
        log.info("worker exit", exit_code=code, step=self.state.step, rank=self.ctx.rank)

    def _exit(self, code: int) -> NoReturn:
        self._log_exit(code)
        exit_worker(code)

    def _settle(self) -> None:
        """Wait for the agreement in flight, so no collective of this step is left behind."""
        if self.agreement is not None:
            self._take(self.agreement.result())

    def _take(self, agreed: tdist.Agreed | None) -> None:
        if agreed is not None and agreed.loss is not None:
            self.loss, self.loss_step = agreed.loss, agreed.step
            try:
                if math.isfinite(agreed.loss):
                    self.first_bad.forget_through(agreed.step)
                elif self.divergence.limit:
                    # One node's NaN in the weights is that node's fault, not the job's.
                    attribute(self.ctx.node_first_rank, self.first_bad, self.suspects,
                              self.state.model, self.device, tdist.collective,
                              self.ctx.is_local_rank0)
                self.divergence.observe(agreed.loss, agreed.step)
            except TrainingDiverged as exc:
                # Every rank agreed this loss: all stop here, none commits (see fail()).
                self.report("diverged", reason=str(exc)[:500])
                raise

    def fail(self, exc: BaseException) -> int:
        """The exit code for an exception that ends the worker, after what can be saved.

        A peer's failure: rank 0 commits the last completed step if the model has not
        been stepped since (an optimizer step after ``step_done`` would make the saved
        step lie about the weights). A newer world owning the checkpoints, or a diverged
        loss: nothing.
        """
        if isinstance(exc, StaleGenerationError):
            return self.on_stale(exc)
        if isinstance(exc, NodeUnfit | PeerUnfit):
            # Nothing to commit: no step was taken. Which node is at fault decides whose
            # daemon leaves the job and whose only restarts (trainer.fitness).
            unfit = isinstance(exc, NodeUnfit)
            log.error("this node cannot resume the job; leaving it" if unfit else
                      "a peer node cannot resume the job; exiting for a restart without it",
                      error=str(exc))
            # (Not self.report: before the resume there is no LR scale to report.)
            self.progress.report("unfit" if unfit else "peer-unfit", self.state.step,
                                 reason=str(exc)[:500])
            return UNFIT_EXIT_CODE if unfit else FAILURE_EXIT_CODE
        if isinstance(exc, TrainingDiverged):
            # Nothing is committed: the weights are those of the diverged steps.
            log.error("training diverged; exiting without committing", step=self.state.step,
                      error=str(exc), exit_code=DIVERGED_EXIT_CODE)
            return DIVERGED_EXIT_CODE
        collective = tdist.is_collective_failure(exc)
        log.error("collective failed; exiting for a restart" if collective else
                  "the training loop raised; exiting", step=self.state.step, error=str(exc)[:500])
        if collective and self.state.step > max(self.saved_step, 0) and self.consistent():
            with contextlib.suppress(Exception):
                self.commit_final("failure")
        return FAILURE_EXIT_CODE

    def consistent(self) -> bool:
        """Whether the live state is exactly that of ``step`` (no optimizer step since)."""
        return self.lr.updates == self._updates_at_done

    def on_stale(self, exc: StaleGenerationError) -> int:
        """A newer world owns the checkpoint directory: this worker is stale; it exits, and
        nothing of it was committed (the fence refused the manifest)."""
        log.error("stale worker: a newer generation owns the checkpoint directory; exiting "
                  "without committing", step=self.state.step, generation=str(exc.generation),
                  fence=str(exc.fence), rank=self.ctx.rank)
        return FAILURE_EXIT_CODE

    def close(self) -> StaleGenerationError | None:
        """Finish the in-flight save; returns its StaleGenerationError if it was refused.

        Idempotent: a second call returns the first one's answer."""
        if self._closed:
            return self._stale
        self._closed = True
        stale = None
        if self.checkpoints is not None:
            try:
                self.checkpoints.close()  # an in-flight periodic save still commits
            except StaleGenerationError as exc:
                stale = exc
                self.on_stale(exc)
            except Exception as exc:  # noqa: BLE001 - report, the exit code says the rest
                log.error("checkpoint write failed", error=str(exc))
        self._stale = stale
        return stale

    def report(self, event: str, **fields: Any) -> None:
        st = self.state
        if event in ("step", "checkpoint"):
            self.reported_step = st.step
        if not self.progress.due(event, st.step):
            return  # most steps: no line due, and the file was rewritten very recently
        lrs = st.lrs_used or self.lr.preview()
        self.progress.report(event, st.step, lr=lrs[0], loss=self.loss, lrs=lrs,
                             epoch=self.epoch, global_batch=st.global_batch,
                             loss_step=self.loss_step, **{**self._position(), **fields})

    def _position(self) -> dict[str, int]:
        """The drop-in sampler's stream position: with the world sizes, the replay's data."""
        position = getattr(self.state.sampler, "position", None)
        return {} if position is None else {"position": int(position)}


def _sampler_of(loader: Any, sampler: Any) -> Any:
    if loader is None:
        return sampler
    from trainer.distributed_sampler import ElasticDistributedSampler

    found = getattr(loader, "sampler", None)
    if not isinstance(found, ElasticDistributedSampler):
        raise ConfigError(
            f"the loader's sampler is {type(found).__name__}: build the DataLoader with "
            "sampler=ElasticDistributedSampler(dataset) (it replaces DistributedSampler), "
            "or pass sampler= and step_done(samples=...) instead of loader=")
    if sampler is not None and sampler is not found:
        raise ConfigError("pass loader= or sampler=, not both")
    return found


def _batch_size(loader: Any) -> int | None:
    if loader is None:
        return None
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        raise ConfigError(
            f"the loader's batch_size is {size!r}: ElasticState(loader=...) counts one batch "
            "of batch_size samples per rank per step; give the DataLoader a batch_size, or "
            "pass sampler= and step_done(samples=...)")
    return size
