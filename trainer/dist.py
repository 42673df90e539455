"""Process-group set-up, DDP wrapping and the per-step agreement collective.

This is the adapter to ``torch.distributed``: its errors are translated here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer import inplace, reform
from trainer.context import ElasticContext
from trainer.errors import ConfigError, TrainerError
from trainer.inplace import CollectiveGuard, Released, is_nccl

log = structlog.get_logger(__name__)

# NCCL's default is 10 minutes, gloo's 30: far too long for a job whose peers can
# vanish. The daemon notices dead peers itself; this is the backstop for a hang.
DEFAULT_TIMEOUT = timedelta(seconds=120)


class CollectiveError(TrainerError):
    """A collective failed: a peer died or timed out. The worker should exit and be restarted."""


# How gloo and NCCL word a dead or hung peer when the failure surfaces as a plain
# RuntimeError (e.g. inside DDP's backward) rather than a DistError.
_TRANSPORT_FAILURE_MARKERS = (
    "gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
    "remote worker", "process group",
)


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` means a peer or collective failed, not a bug in the script."""
    if isinstance(exc, (dist.DistError, CollectiveError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _TRANSPORT_FAILURE_MARKERS)


# In-place mode: every collective's wait goes through this guard (see trainer.inplace),
# so the daemon's next generation releases a worker blocked on a lost or frozen peer.
_GUARD: CollectiveGuard | None = None


def install_guard(guard: CollectiveGuard | None) -> None:
    """Route the collectives of this module (and DDP's, via ``wrap_ddp``) through ``guard``."""
    global _GUARD
    if _GUARD is not None:
        _GUARD.close()
    _GUARD = guard


def guard_released() -> str | None:
    """Why the installed guard released its waiters, if it did."""
    return None if _GUARD is None else _GUARD.why


def guard_unfinished() -> int:
    """How many collectives of the guarded group are still unfinished (0 without a guard)."""
    return 0 if _GUARD is None else _GUARD.unfinished()


def synced_backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` where DDP all-reduces gradients; peer failures become CollectiveError."""
    try:
        loss.backward()
    except RuntimeError as exc:
        if is_collective_failure(exc) or guard_released() is not None:
            raise CollectiveError(f"gradient all-reduce failed (a peer is gone?): {exc}") from exc
        raise


def choose_backend(backend: str = "auto") -> str:
    """``nccl`` when CUDA is available (and ``auto``), else ``gloo``."""
    if backend != "auto":
        return backend
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for(ctx: ElasticContext, backend: str) -> torch.device:
    """The device this worker computes on: ``cuda:LOCAL_RANK`` under NCCL, else CPU."""
    if is_nccl(backend):
        return torch.device("cuda", ctx.local_rank)
    return torch.device("cpu")


def init_distributed(
    ctx: ElasticContext | None = None,
    backend: str = "auto",
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> torch.device:
    """Join the process group of torchrun's world (``env://``) and return this worker's device.

    NCCL: binds ``cuda:LOCAL_RANK`` and turns on asynchronous error handling
    (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, tear down the communicator and the
    process when a collective fails or exceeds ``timeout``, so torchrun restarts the
    worker instead of it hanging; ``2`` in in-place mode: the communicator only, the
    process re-forms the group, see trainer.inplace). ``TORCH_NCCL_BLOCKING_WAIT`` is left unset: with
    async handling it is redundant and would make every wait synchronous. Both are
    set only if the user has not set them. gloo enforces ``timeout`` itself.
    In in-place mode the group is created so that it can be re-formed by torch's
    reconfigure API where the installed torch and the backend have it (``trainer.reform``;
    NCCL then through ``nccl2``), else as always (re-formed by destroy + init).
    Idempotent: a second call returns the device without re-initialising.
    """
    ctx = ctx or ElasticContext.from_env()
    if dist.is_initialized():  # the script's own init_process_group: its backend decides
        return device_for(ctx, dist.get_backend())
    backend, device = prepare_backend(ctx, backend)
    os.environ.setdefault("MASTER_ADDR", ctx.master_addr)
    os.environ.setdefault("MASTER_PORT", str(ctx.master_port))
    mechanism = reform.DESTROY_INIT
    try:
        if ctx.in_place:
            mechanism = _create_in_place_group(ctx, backend, device, timeout)
        else:
            dist.init_process_group(backend=backend, init_method="env://", rank=ctx.rank,
                                    world_size=ctx.world_size, timeout=timeout,
                                    device_id=device if is_nccl(backend) else None)
    except (RuntimeError, ValueError, inplace.ReformError) as exc:
        raise CollectiveError(
            f"could not join the {backend} process group at {ctx.master_addr}:"
            f"{ctx.master_port} as rank {ctx.rank}/{ctx.world_size}: {exc}"
        ) from exc
    log.info("process group ready", backend=backend, rank=ctx.rank,
             world_size=ctx.world_size, device=str(device), timeout_s=timeout.total_seconds(),
             reform=mechanism)
    return device


def prepare_backend(ctx: ElasticContext, backend: str = "auto") -> tuple[str, torch.device]:
    """The backend to create this worker's group with, and its device (bound on CUDA).

    In place, a failed NCCL collective must leave the process alive to re-form:
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up the communicator only) instead of 1
    (also kill the process), and a reconfigurable group goes through ``nccl2``."""
    backend = choose_backend(backend)
    device = device_for(ctx, backend)
    if is_nccl(backend):
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2" if ctx.in_place else "1")
        torch.cuda.set_device(device)
        if ctx.in_place and ctx.reform == "auto" and backend == "nccl":
            backend = reform.nccl_backend()
    return backend, device


def _create_in_place_group(ctx: ElasticContext, backend: str, device: torch.device,
                           timeout: timedelta) -> str:
    """torchrun's world as a group the in-place path can re-form; its mechanism."""
    store, rank, world_size = next(dist.rendezvous("env://", rank=ctx.rank,
                                                   world_size=ctx.world_size, timeout=timeout))
    assert ctx.generation_id is not None  # ctx.in_place says so
    return reform.create_group(backend, store, rank, world_size, ctx.generation_id, timeout,
                               device if is_nccl(backend) else None, mechanism=ctx.reform)


def wrap_ddp(model: torch.nn.Module, device: torch.device, **ddp_kwargs) -> DistributedDataParallel:
    """Move ``model`` to ``device`` and wrap it in DDP (parameters broadcast from rank 0,
    unless ``init_sync=False``); with a guard installed, its gradient all-reduce goes
    through the guard."""
    if not dist.is_initialized():
        raise ConfigError("wrap_ddp needs a process group: call init_distributed() first")
    model = model.to(device)
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids, **ddp_kwargs)
    if _GUARD is not None:
        ddp.register_comm_hook(None, _GUARD.comm_hook)
    return ddp


def step_boundary(stop: bool, loss_sum: float, device: torch.device) -> tuple[bool, float]:
    """The one small collective per step: did any rank ask to stop, and the global loss sum.

    Every rank must call it once per step, in the same order as its other collectives.
    """
    buf = torch.tensor([1.0 if stop else 0.0, loss_sum], dtype=torch.float64, device=device)
    all_reduce(buf)
    return bool(buf[0].item() > 0), float(buf[1].item())


def broadcast_int(value: int, device: torch.device, src: int = 0) -> int:
    """``value`` as held by rank ``src``, on every rank."""
    buf = torch.tensor([value], dtype=torch.int64, device=device)
    collective("broadcast", lambda **kw: dist.broadcast(buf, src=src, **kw))
    return int(buf.item())


def all_reduce(buf: torch.Tensor) -> None:
    """Sum ``buf`` over ranks in place; a peer failure becomes CollectiveError."""
    collective("all_reduce", lambda **kw: dist.all_reduce(buf, **kw))


def barrier() -> None:
    """Wait for every rank; a peer failure becomes CollectiveError.

    An all-reduce of one element, not ``dist.barrier``: gloo's barrier also waits for
    every collective still in flight on the group, and after a reconfigure
    (trainer.reform) one that was stuck on a frozen, evicted peer stays in flight until
    the group's timeout (measured: the final barrier hung there, the survivors' steps done).
    """
    device = torch.device("cuda") if is_nccl(dist.get_backend()) else torch.device("cpu")
    token = torch.zeros(1, device=device)
    collective("barrier", lambda **kw: dist.all_reduce(token, **kw))


def collective(what: str, call: Callable[..., Any]) -> None:
    """Run one collective (through the guard when one is installed); translate its errors.

    ``call(async_op=...)`` starts it (the guard waits on the work it returns)."""
    with _translated(what):
        if _GUARD is None:
            call()
        else:
            _GUARD.wait(call(async_op=True), what)


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """A peer failure or a guard release inside the block becomes CollectiveError."""
    try:
        yield
    except Released as exc:
        raise CollectiveError(f"{what} released: {exc}") from exc
    except (RuntimeError, ValueError) as exc:
        raise CollectiveError(f"{what} failed (a peer is gone?): {exc}") from exc


# How often the ranks agree at most (stop? the loss): a stop is then seen within this
# plus one step. Per step, the post (an async all-reduce) cost 0.35-0.45 ms of the
# training thread here, ~0.8% of a 50 ms step; a few times a second it is noise.
AGREE_INTERVAL_S = 0.25
MAX_AGREE_EVERY = 1000  # steps: bounds the wait for a stop when the steps slow down


def agree_every(mean_step_us: int, interval_us: int) -> int:
    """Steps between two posts: as many as fit in ``interval_us`` (1 when the step time is
    unknown or longer), at most ``MAX_AGREE_EVERY``.

    Integer arithmetic on the all-reduced step time, so every rank gets the same answer.
    """
    if mean_step_us <= 0:
        return 1
    return max(1, min(MAX_AGREE_EVERY, interval_us // mean_step_us))


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed on after ``step``: any rank stopping? its loss; the cadence."""

    step: int
    stop: bool
    loss: float | None  # the global loss of ``step`` (summed over ranks, / the divisor)
    every: int  # steps from ``step`` to the next post
    change: bool = False  # every rank had seen a planned generation (trainer.recover)


class Agreement:
    """The ranks' agreement (any rank stopping? every rank seen a planned membership
    change? the loss), read one step after its post.

    ``after_step`` is called by every rank after every step. On a post step it starts an
    asynchronous all-reduce of [stop, loss sum, the rank's mean step time in us, 1,
    change seen]; the
    next step reads it (the reduction ran in the background during that step, so the
    wait costs nothing in steady state: no blocking collective of its own). Posts are
    ``agree_every`` steps apart, fitted to ``interval_s`` from the agreed step time, so
    every rank posts after the same steps: the cadence is itself agreed. A stop requested
    anywhere is seen by every rank after the same step, within ``interval_s`` plus a step.
    On CUDA the result comes back through a pinned buffer and an event recorded behind
    the all-reduce, so reading it does not wait for the step queued since; a device loss
    is never read on the steps between posts.
    """

    def __init__(self, device: torch.device, interval_s: float = AGREE_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ConfigError(f"agree_interval_s={interval_s} must be >= 0 (0: every step)")
        self.device = device
        self.interval_us = round(interval_s * 1e6)
        self._clock = clock
        self._pending: tuple[object, torch.Tensor, object, int, float | None] | None = None
        self._next = 0  # the first step to post after
        self._mark: tuple[int, float] | None = None  # (step, time) of the last post

    def after_step(self, step: int, stop: bool, loss_sum: float | torch.Tensor | None,
                   loss_divisor: float = 1.0, change: bool = False) -> Agreed | None:
        """This rank finished ``step``: read the agreement in flight (posted after an
        earlier step), post the next one when due; what was agreed, or None. ``change``:
        this rank has seen a planned membership change. Once one is agreed (or a stop)
        nothing is posted: the group is about to be left, with no collective in flight."""
        agreed = None
        if self._pending is not None and step > self._pending[3]:
            agreed = self.result()
        if agreed is not None and (agreed.change or agreed.stop):
            return agreed
        if self._pending is None and step >= self._next:
            self._post(step, stop, loss_sum, loss_divisor, change)
        return agreed

    def _post(self, step: int, stop: bool, loss_sum: float | torch.Tensor | None,
              divisor: float, change: bool = False) -> None:
        now = self._clock()
        mean_us = 0
        if self._mark is not None and step > self._mark[0]:
            mean_us = round(1e6 * (now - self._mark[1]) / (step - self._mark[0]))
        self._mark = (step, now)
        flag, seen = (1.0 if stop else 0.0), (1.0 if change else 0.0)
        if self.device.type == "cpu":  # one tensor build (element writes cost ~65 us here)
            loss = loss_sum.detach() if isinstance(loss_sum, torch.Tensor) else loss_sum
            buf = torch.tensor([flag, 0.0 if loss is None else float(loss), mean_us, 1.0, seen],
                               dtype=torch.float64)
        else:  # no .item() and no host copy: either would wait for the step queued behind
            buf = torch.zeros(5, dtype=torch.float64, device=self.device)
            buf[0], buf[2], buf[3], buf[4] = flag, mean_us, 1.0, seen
            if loss_sum is not None:
                buf[1] = loss_sum.detach() if isinstance(loss_sum, torch.Tensor) else loss_sum
        with _translated("stop agreement"):
            work = dist.all_reduce(buf, async_op=True)
        if _GUARD is not None:  # in flight until the next step reads it
            _GUARD.track(work)
        event = None
        if buf.is_cuda:
            buf, event = self._to_host(work, buf)
        self._pending = (work, buf, event, step, None if loss_sum is None else divisor)

    def result(self) -> Agreed | None:
        """Wait for the posted reduction (through the guard) and return it; None if none."""
        if self._pending is None:
            return None
        work, buf, event, step, divisor = self._pending
        self._pending = None
        with _translated("stop agreement"):
            if _GUARD is not None:  # a lost or frozen peer must not hold this wait
                _GUARD.wait(work, "stop agreement")
            elif event is None:
                work.wait()
            if event is not None:
                event.synchronize()
        stop, loss, step_us, ranks, seen = buf.tolist()
        every = agree_every(int(step_us) // max(1, int(ranks)), self.interval_us)
        self._next = step + every
        return Agreed(step=step, stop=stop > 0, loss=None if divisor is None else loss / divisor,
                      every=every, change=ranks > 0 and seen == ranks)

    def discard(self) -> None:
        """Forget a reduction of a group that is gone (an in-place re-form posts anew)."""
        self._pending, self._next, self._mark = None, 0, None

    @staticmethod
    def _to_host(work, buf: torch.Tensor) -> tuple[torch.Tensor, object]:
        work.wait()  # on CUDA: the current stream waits for the all-reduce, the host does not
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
        host.copy_(buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event


# Objects whose destructors must never run in the training thread; see shutdown().
RETAINED: list[object] = []


def retain(*objects: object) -> None:
    """Keep ``objects`` alive until the process exits (see ``shutdown`` for why)."""
    RETAINED.extend(objects)


def shutdown(*keep: object) -> None:
    """Leave the process group, keeping it (and ``keep``, e.g. the DDP model) alive until exit.

    Why keep them: destroying a gloo process group joins its worker threads while the
    caller holds the GIL, and a worker thread still releasing a finished collective's
    tensors needs the GIL: a deadlock (measured: about one run in six hung after the
    final barrier, in ``~Reducer`` -> ``~ProcessGroupGloo`` -> ``thread::join``).
    End the process with ``exit_worker`` so those destructors never run.
    """
    retain(*keep)
    if dist.is_initialized():
        retain(dist.group.WORLD)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.warning("process group teardown failed", error=str(exc))
