"""What a trainer checkpoint holds, and how it is restored.

Only tensors and plain values (the checkpoint loads with ``weights_only=True``).
There is no RNG state: randomness inside a step is reseeded from
(seed, step, rank) at every step (``step_seed``), so a resume at any world size
draws exactly what a run without the interruption would have drawn.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
import torch

from trainer.errors import CheckpointMismatch
from trainer.lr import LRScale

log = structlog.get_logger(__name__)

FORMAT_VERSION = 1


def _feed(h: Any, value: Any) -> None:
    """``value`` into hash ``h``, the same bytes for equal values: dicts by sorted key,
    tensors by dtype, shape and their bytes, anything else by its type and repr."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(f"k{key!s}:".encode())
            _feed(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(f"l{len(value)}:".encode())
        for item in value:
            _feed(h, item)
    elif isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"t{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(f"{type(value).__name__}{value!r}:".encode())


class Stateful(Protocol):
    """What a checkpoint can hold besides tensors: torch's ``state_dict`` protocol."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class TrainState:
    """The live, resumable state of a run: what a checkpoint of ``step`` captures.

    ``sampler`` is an ``ElasticSampler`` (ElasticTrainer) or an
    ``ElasticDistributedSampler`` (a hand-written loop); ``stateful`` holds the
    optional extras by checkpoint key: ``scheduler``, ``scaler`` and the script's own
    objects under ``extra.<name>``.
    """

    model: torch.nn.Module  # the unwrapped module
    optimizer: torch.optim.Optimizer
    sampler: Any
    step: int = 0
    scale: LRScale | None = None
    lrs_used: list[float] | None = None
    world_size: int = 1
    global_batch: int = 0
    stateful: dict[str, Stateful] = field(default_factory=dict)

    def to_checkpoint(self) -> dict[str, Any]:
        """The nested dict handed to ``CheckpointManager.save``."""
        assert self.scale is not None
        state = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr": {"scale": self.scale.state_dict(), "lrs_used": list(self.lrs_used or [])},
            "world": {"world_size": self.world_size, "global_batch": self.global_batch},
        }
        if self.sampler is not None:
            state["sampler"] = self.sampler.state_dict()
        if self.stateful:
            state["stateful"] = {key: obj.state_dict() for key, obj in self.stateful.items()}
        return state

    def digest(self) -> str:
        """A sha256 of what every rank holds alike once a hand-over is done: the step, the
        model, the optimizer's per-parameter state (not its param groups: their LRs are
        re-applied just after) and the sampler's position. Equal on two ranks means their
        states are bit-equal (a joiner's to its holder's)."""
        h = hashlib.sha256()
        _feed(h, {"step": self.step, "model": self.model.state_dict(),
                  "optimizer": self.optimizer.state_dict()["state"],
                  "sampler": self.sampler.state_dict() if self.sampler is not None else None})
        return h.hexdigest()

    def load_checkpoint(self, saved: dict[str, Any], step: int) -> LRScale:
        """Restore model, optimizer and data position; return the saved LR scale.

        The optimizer's param-group LRs come back stale; the caller re-applies the
        rescaled LR right after this.
        """
        if saved.get("format") != FORMAT_VERSION or saved.get("step") != step:
            raise CheckpointMismatch(
                f"checkpoint of step {step} has format {saved.get('format')!r} and step "
                f"{saved.get('step')!r}; it was not written by this trainer version: use a "
                "fresh checkpoint directory"
            )
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.sampler is not None:
            if "sampler" not in saved:
                raise CheckpointMismatch(
                    f"checkpoint of step {step} holds no data position: it was written by a "
                    "loop without an elastic sampler; resume without one or use a fresh "
                    "checkpoint directory")
            self.sampler.load_state_dict(saved["sampler"])
        self._load_stateful(saved.get("stateful", {}), step)
        self.step = step
        self.lrs_used = [float(x) for x in saved["lr"]["lrs_used"]]
        return LRScale.from_state_dict(saved["lr"]["scale"])


    def _load_stateful(self, saved: dict[str, Any], step: int) -> None:
        # A scheduler added to (or dropped from) a script mid-run must not end a week-long
        # job: the fresh object keeps its own state, and the log says which one.
        for key, obj in self.stateful.items():
            if key in saved:
                obj.load_state_dict(saved[key])
            else:
                log.warning("checkpoint holds no state for this object; it starts fresh",
                            key=key, step=step)
        for key in sorted(set(saved) - set(self.stateful)):
            log.warning("checkpoint state not restored: nothing registered under its key",
                        key=key, step=step, hint="register it with the same name")


def step_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` during ``step``: independent streams, reproducible on resume.

    A BLAKE2b hash of the three numbers (63 bits): well mixed, 2 us of mostly C. It was
    numpy's ``SeedSequence`` (20-30 us alone; a run resumed across the change draws other
    dropout masks): at a 50 ms step ElasticTrainer without its per-step reseed spent
    0.5 ms less rank-0 CPU per step than with it (benchmarks/results/steady_state.md),
    far more than the pieces timed alone, so the step's code is kept small.
    """
    digest = hashlib.blake2b(struct.pack("<qqq", seed, step, rank), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed(seed: int, device: torch.device) -> None:
    """Seed the generators a step on ``device`` draws from: the CPU's, and the GPU's on CUDA.

    Not ``torch.manual_seed``: that also walks every accelerator backend (CUDA's lazy
    queue, MPS, XPU, custom devices) and cost 0.3-1.9 ms per call here against 5 us for
    the generator itself, a few percent of a 50 ms step when done every step.
    """
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(seed)
