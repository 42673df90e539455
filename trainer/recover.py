"""In-place recovery for any loop on ``ElasticState``: one implementation for both APIs.

``InPlace`` guards every collective (so the daemons' next generation releases a worker
blocked on a lost or frozen peer) and, after a failed collective, re-forms the group
in that generation: abandon the old group, join the new one through the record's
store, agree on the newest state (its holder sends it), adopt the new rank and world
(LR rescale, checkpoint writer, the loop's own batch layout through ``on_world``) and
wrap the model in a new DDP. Every step is bounded by ``ctx.recovery_bound_s``; past it,
or on any failure, the caller falls back to the process restart. The pieces (guard,
watch, group join, state hand-over) are ``trainer.inplace``'s.

``ElasticTrainer`` (trainer.loop) and a hand-written loop run through
``ElasticState.run`` both recover here.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import structlog
import torch

from checkpointing.errors import StaleGenerationError
from elasticd.contract.generation import GenerationId, GenerationRecord
from elasticd.contract.secret import SecretError, read_secret
from trainer import dist as tdist
from trainer import inplace, reform, transfer
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.context import ElasticContext
    from trainer.elastic import ElasticState
    from trainer.state import TrainState

log = structlog.get_logger(__name__)

# "1": every rank logs its state's digest (``TrainState.digest``) after each hand-over, so a
# test can prove a joiner's state bit-equal to its holder's.
STATE_DIGEST_ENV = "ELASTICD_STATE_DIGEST"


class InPlace:
    """The re-form of ``es``'s group in place; ``on_world()`` is called once the new
    rank and world size are in ``es.ctx`` (a loop's batch layout follows them there)."""

    def __init__(self, es: ElasticState, timeout: timedelta,
                 ddp_kwargs: dict[str, Any] | None = None,
                 on_world: Callable[[], None] | None = None) -> None:
        self.es = es
        self.timeout = timeout
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.on_world = on_world or (lambda: None)
        self.mechanism = ""  # the last re-form's (trainer.reform)
        self.stuck = False  # whether the old group's collectives could be stuck then

    @property
    def enabled(self) -> bool:
        return self.es.ctx.in_place

    @property
    def backend(self) -> str:
        """The backend of the group at hand (``nccl2`` where a reconfigurable NCCL group
        was created: the script's choice said ``nccl``)."""
        return str(torch.distributed.get_backend())

    def wrap(self, model: torch.nn.Module, reformed: bool = False) -> torch.nn.Module:
        """``model`` in DDP over the current group (its collectives through the guard).

        After a re-form the states are identical already: no initial broadcast."""
        kwargs = {**self.ddp_kwargs, "init_sync": False} if reformed else self.ddp_kwargs
        return tdist.wrap_ddp(model, self.es.device, **kwargs)

    def install_guard(self) -> None:
        """In in-place mode, every collective waits through a guard that the daemon's next
        generation releases (the silent-peer case: nothing else would release it).

        Also freezes what exists by then (torch's modules, the model, the optimizer: ~170k
        objects) out of the cyclic collector, so that ``release_old``'s collection after a
        re-form scans only what was made since: it took 0.29 s of a drain's 0.39 s pause
        under load, where nothing else of the re-form took over 0.03 s."""
        ctx = self.es.ctx
        if not ctx.in_place:
            return
        gc.freeze()
        assert ctx.generation_file is not None and ctx.generation_id is not None
        watch = inplace.GenerationWatch(ctx.generation_file, ctx.generation_id)

        def released() -> str | None:
            # A planned change is taken at the step boundary the ranks agree (trainer.
            # elastic): it releases nothing; a loss's record, or one superseding it, does.
            record = watch.newer()
            return None if record is None or record.planned else (
                f"the daemons formed generation {record.id} without {', '.join(record.lost)}")

        tdist.install_guard(inplace.CollectiveGuard(released, self.backend,
                                                    self.timeout.total_seconds()))

    def recover(self, exc: BaseException, ddp: torch.nn.Module) -> torch.nn.Module | None:
        """Re-form the group in the next generation: the new DDP module, or None (after
        reporting why) when this worker must exit for a torchrun restart instead."""
        es = self.es
        if not self.enabled:
            return None
        started = time.monotonic()
        from_world, from_gen = es.ctx.world_size, es.ctx.generation_id
        if isinstance(exc, inplace.MembershipChange):
            cause = exc.record.cause or "planned"
            log.info(f"membership change agreed after step {es.state.step}; re-forming the "
                     "group in place", generation=str(from_gen), to=str(exc.record.id),
                     joined=list(exc.record.joined), left=list(exc.record.lost))
        else:
            cause = "released" if tdist.guard_released() else "collective-failed"
            log.warning("collective failed; re-forming the group in place", step=es.state.step,
                        generation=str(from_gen), cause=cause, error=str(exc)[:300])
        try:
            if not es.consistent():
                # The loop stepped the optimizer but not step_done (a collective of its
                # own between them failed): no step number describes these weights.
                raise inplace.ReformError("the weights were stepped after the last "
                                          "step_done; only a restart from a checkpoint is exact")
            record, ddp = self._reform(ddp, started + es.ctx.recovery_bound_s)
        except (inplace.ReformError, tdist.CollectiveError, StaleGenerationError) as err:
            took = time.monotonic() - started
            es.report("reform-failed", reason=str(err)[:500], duration_s=round(took, 4))
            log.error(f"in-place re-form failed after {took:.2f} s; exiting for a torchrun "
                      "restart", reason=str(err)[:500])
            return None
        took = time.monotonic() - started
        es.report("reformed", from_world_size=from_world, duration_s=round(took, 4),
                  cause=cause, lost=list(record.lost), joined=list(record.joined),
                  mechanism=self.mechanism, stuck=self.stuck)
        log.info(f"re-formed in place in {took:.3f} s by {self.mechanism}: rank {es.ctx.rank} "
                 f"of {es.ctx.world_size} in generation {record.id} (was {from_world} in "
                 f"{from_gen}); next is step {es.state.step + 1}")
        return ddp

    @staticmethod
    def release_old() -> None:
        """Free the old DDP wrapper once the caller dropped it (after its ``except``
        block: the traceback's frames hold it too). DDP's hooks make reference cycles, so
        without a collection its gradient buckets (a model's size) lived until Python's
        next full collection. Safe in this thread: ``_reform`` kept the group it held."""
        gc.collect()

    def _reform(self, ddp: torch.nn.Module, deadline: float
                ) -> tuple[GenerationRecord, torch.nn.Module]:
        def left() -> float:
            return deadline - time.monotonic()

        es, ctx = self.es, self.es.ctx
        assert ctx.generation_file is not None and ctx.generation_id is not None
        record = inplace.GenerationWatch(ctx.generation_file, ctx.generation_id).wait(deadline)
        rank = self._rank_in(record)
        assert es.agreement is not None
        es.agreement.discard()  # the old group's; stop requests are re-sent (sticky)
        backend = self.backend
        # The old group's collectives may be stuck: released from a frozen peer, or left
        # unfinished by a survivor that gave up its side of them (reform.Renew says why).
        self.stuck = tdist.guard_released() is not None or tdist.guard_unfinished() > 0
        tdist.install_guard(None)
        mechanism = reform.mechanism_for(backend, tdist.RETAINED, self.stuck)
        self.mechanism = mechanism.name
        if mechanism.name != reform.RECONFIGURE:
            # The abandoned group must never be destroyed in this thread (tdist.shutdown
            # says why); the old DDP's reducer holds it, so keep the group alone. Keeping
            # the whole wrapper cost its gradient buckets (a model's size) per re-form.
            tdist.retain(getattr(ddp, "process_group", None) or torch.distributed.group.WORLD)
        mechanism.leave(left())
        while True:
            watch = inplace.GenerationWatch(ctx.generation_file, record.id)
            try:
                mechanism.join(record, rank, backend, es.device, self.timeout, left(),
                               newer=watch.newer)
                break
            except inplace.Superseded as exc:
                log.warning(f"generation {exc.record.id} was agreed while joining {record.id} "
                            "(a member never came); joining it instead",
                            lost=list(exc.record.lost))
                record = exc.record
                rank = self._rank_in(record)
            except torch.distributed.DistError as exc:
                # The generation's store (the new rank 0's daemon's) or a member failed while
                # forming: the daemons agree the next generation without that node. Follow
                # it within the bound, else ReformError (a torchrun restart).
                log.warning(f"forming generation {record.id} failed ({type(exc).__name__}); "
                            "waiting for the next generation", error=str(exc)[:300])
                record = watch.wait(deadline)
                rank = self._rank_in(record)
        inplace.bounded(lambda: self._sync_state(record), left(), "agreeing on the newest state")
        if es.state.step > es.reported_step:
            # A step whose all-reduce completed here (or on the holder) but whose boundary
            # collective did not: it was a step of the old world, and its record says so.
            es.report("step")
        self._adopt(record, rank)
        es.rescale(es.state.scale)
        self.install_guard()
        return record, self.wrap(es.state.model, reformed=True)

    def _rank_in(self, record: GenerationRecord) -> int:
        return rank_in(self.es.ctx, record)

    def _adopt(self, record: GenerationRecord, rank: int) -> None:
        adopt(self.es, record, rank, self.on_world)

    def _sync_state(self, record: GenerationRecord) -> None:
        """Every member continues from the newest completed step (see trainer.inplace)."""
        hand_over(self.es.state, self.es.device, record, secret_file=self.es.ctx.secret_file)


@functools.cache
def job_secret(path: str | None) -> bytes | None:
    """The job's secret, read once per process (``ReformError`` if it cannot be used)."""
    if path is None:
        return None
    try:
        return read_secret(path)
    except SecretError as exc:
        raise inplace.ReformError(str(exc)) from None


def rank_in(ctx: ElasticContext, record: GenerationRecord) -> int:
    """This worker's rank in ``record`` (ReformError where it names this worker not)."""
    rank = record.rank_of(ctx.node_id or "", ctx.local_rank)
    if rank is None:
        raise inplace.ReformError(
            f"generation {record.id} does not name node {ctx.node_id} (local rank "
            f"{ctx.local_rank}): this worker was fenced out")
    return rank


def adopt(es: ElasticState, record: GenerationRecord, rank: int,
          on_world: Callable[[], None]) -> None:
    """This worker's place in the new generation: rank, world, writer role, and the
    loop's layout (``on_world``)."""
    was_rank0 = es.ctx.is_rank0
    es.ctx = dataclasses.replace(es.ctx, rank=rank, world_size=record.world_size,
                                 generation_seq=record.id.seq)
    es.progress.ctx = es.ctx
    es.state.world_size = es.ctx.world_size
    on_world()
    if es.checkpoints is None or not es.ctx.is_rank0:
        return
    if was_rank0:
        es.checkpoints.advance_generation(record.id.seq)
    else:  # rank 0 was lost: this survivor is the writer now
        es.open_checkpoints()


def enter_live(es: ElasticState, backend: str = "auto", timeout: timedelta = tdist.DEFAULT_TIMEOUT,
               on_world: Callable[[], None] = lambda: None) -> torch.device:
    """A newcomer (``ELASTICD_JOINING=1``) enters the live group of the generation that
    names its node among the joined, beside the members re-forming into it (each on its
    ``MembershipChange``), and takes the newest state from the lowest rank holding it: no
    checkpoint is read, no shared directory needed. It reports ``warm`` once its device and
    model are ready and waits for that record as long as its daemon keeps it; the entry is
    bounded by ``recovery_bound_s``, past which ``CollectiveError`` (the worker exits, its
    daemon takes the restart path). Returns this worker's device."""
    ctx = es.ctx
    if not ctx.in_place:
        raise ConfigError("ELASTICD_JOINING=1 needs the in-place mode: set ELASTICD_RECOVERY_MODE="
                          "in-place, ELASTICD_GENERATION_FILE, ELASTICD_NODE_ID and "
                          "ELASTICD_GENERATION (the daemon does)")
    # Warm first: the device bound and the model on it (a CUDA context, the costly part on
    # a GPU) before anyone waits on this worker; then it says so and waits to be admitted.
    backend, device = tdist.prepare_backend(ctx, backend)
    es.state.model.to(device)  # before the hand-over: the optimizer state lands beside it
    es.progress.report("warm", es.state.step)  # (no LR yet: the state comes with the entry)
    try:
        record = admission(ctx)
        started = time.monotonic()  # the members' wait starts with the record, so does ours
        deadline = started + ctx.recovery_bound_s
        record, mechanism = _enter(ctx, record, backend, device, timeout, deadline)
        step = inplace.bounded(lambda: hand_over(es.state, device, record, newcomer=True,
                                                 secret_file=ctx.secret_file),
                               deadline - time.monotonic(), "receiving the newest state")
    except (inplace.ReformError, torch.distributed.DistError) as exc:
        raise tdist.CollectiveError(f"could not enter the live group as a newcomer: {exc}") from exc
    adopt(es, record, rank_in(ctx, record), on_world)
    es.rescale(es.state.scale)
    es.entered_live = True
    es.reported_step = step  # (the step the holder sent: not this worker's to report)
    took = time.monotonic() - started
    es.report("reformed", from_world_size=None, duration_s=round(took, 4), cause=record.cause,
              lost=list(record.lost), joined=list(record.joined), mechanism=mechanism,
              stuck=False, newcomer=True)
    log.info(f"entered generation {record.id} in {took:.3f} s by {mechanism}: rank "
             f"{es.ctx.rank} of {es.ctx.world_size}, at step {step} from a live peer")
    return device


def admission(ctx: ElasticContext, deadline: float = math.inf) -> GenerationRecord:
    """The record in this worker's generation file, of its round, that names its node
    among the joined (ReformError once ``deadline`` passes without one). A warm newcomer
    waits as long as its daemon keeps it: the daemon admits it when the members agree,
    and ends it (its agent, then the orphan watchdog) when it will not."""
    assert ctx.generation_file is not None and ctx.generation_id is not None
    # Any record of the round is newer than seq -1's; the one sought names this node.
    watch = inplace.GenerationWatch(ctx.generation_file, GenerationId(
        ctx.generation_id.round, 0, ctx.generation_id.epoch))
    node = ctx.node_id or ""
    return watch.wait(deadline, accept=lambda record: node in record.joined,
                      wanted=f" naming node {node} among the joined")


def _enter(ctx: ElasticContext, record: GenerationRecord, backend: str, device: torch.device,
           timeout: timedelta, deadline: float) -> tuple[GenerationRecord, str]:
    """Join ``record``'s group, following any newer record that still names this node."""
    while True:
        watch = inplace.GenerationWatch(ctx.generation_file or "", record.id)
        try:
            return record, reform.join_as_newcomer(
                record, rank_in(ctx, record), backend, device, timeout,
                deadline - time.monotonic(), ctx.reform, newer=watch.newer)
        except inplace.Superseded as exc:
            log.warning(f"generation {exc.record.id} was agreed while entering {record.id}; "
                        "entering it instead", lost=list(exc.record.lost))
            record = exc.record


def hand_over(st: TrainState, device: torch.device, record: GenerationRecord,
              newcomer: bool = False, secret_file: str | None = None) -> int:
    """Every member of the new group first proves it knows the job's secret (if the job
    has one: ``secret_file``; ``inplace.vouch``), then continues from the newest completed
    step: the lowest
    rank holding it sends its whole training state (model, optimizer, sampler, LR scale,
    scheduler, scaler, RNG, extras: ``TrainState.to_checkpoint``) to the members that do
    not hold it; a ``newcomer`` holds none, and no state is taken from ``record``'s joined
    ranks, whatever they claim. Members at that step already keep theirs (DDP made them
    identical). Returns the step."""
    inplace.vouch(record, job_secret(secret_file), device)
    newest, holder, every = inplace.newest_state(-1 if newcomer else st.step, device,
                                                 record.joined_ranks)
    needs = [r for r, step in enumerate(every) if step != newest]
    rank = torch.distributed.get_rank()  # in the new group (the context follows)
    if rank == holder and needs:
        transfer.send_state(st.to_checkpoint(), holder, device, needs)
    elif rank in needs:
        st.scale = st.load_checkpoint(transfer.send_state(None, holder, device, needs), newest)
    if needs:
        log.info("training state handed over", step=newest, holder=holder, steps=every)
    if os.environ.get(STATE_DIGEST_ENV) == "1":   # a full pass over the state: tests, diagnosis
        log.info("training state digest", step=newest, digest=st.digest())
    return newest


__all__ = ["InPlace", "admission", "adopt", "enter_live", "hand_over", "rank_in"]
