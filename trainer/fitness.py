"""Whether every node of a new world can resume: a node that cannot is charged with it.

A worker that could not resume (its checkpoint directory lacks the job's newest commit:
a failed mount, a node without the shared filesystem) used to raise alone; its peers'
next collective then failed, every node's workers exited as if they had crashed, and
every daemon spent its own crash budget until all were FAILED (issue 29: one
misconfigured joiner ended a 3-node job in 17 s). And a rank 0 without the checkpoints
broadcast "nothing to resume": the whole job would have started again from step 0.

Instead every rank says what it can do in one all-gather, before anything is loaded:
its node (the node's first rank: torchrun gives each agent a contiguous range) and the
newest step its checkpoint directory shows committed. The job's newest checkpoint is the
newest any rank sees (only the fenced rank 0 ever commits). A rank that sees an older one
waits ``VISIBLE_S`` for it to appear (a network filesystem's attribute cache can lag a
few seconds), then all ranks gather again. A node with any rank still behind is *unfit*:
its workers raise ``NodeUnfit`` (their daemon leaves the job, saying why and what to fix);
the others raise ``PeerUnfit`` (their daemons count no crash: the agents restart the
workers, and the next round forms without the unfit node). A load of the agreed step
that fails on some rank only is judged the same way (``judge_loads``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch
import torch.distributed as dist

from trainer.errors import TrainerError

log = structlog.get_logger(__name__)

# How long a rank whose directory shows an older checkpoint than a peer's waits for the
# newer one to appear before its node is judged unfit.
VISIBLE_S = 10.0
POLL_S = 0.5
NONE = -1  # no committed checkpoint (or no checkpoint directory)
MOUNT_FIX = ("mount the job's shared checkpoint directory at that path on this node (every "
             "node must see the same directory), then start elasticd again")


class NodeUnfit(TrainerError):
    """This node's workers cannot resume the job: its daemon leaves the job (the others
    go on without it); the message names the cause and the fix."""


class PeerUnfit(TrainerError):
    """A peer node cannot resume the job: exit so that the next round forms without it
    (a membership change, not this node's crash)."""


@dataclass(frozen=True)
class Report:
    """What one rank said: its node (first rank) and the newest checkpoint it sees, or
    whether its load of the agreed step worked (1) or not (0)."""

    node: int
    value: int


def unfit_nodes(reports: Sequence[Report], wanted: int) -> set[int]:
    """The nodes with a rank whose value is below ``wanted``."""
    return {r.node for r in reports if r.value < wanted}


def gather(node: int, value: int, device: torch.device,
           collective: Callable[[str, Callable], None]) -> list[Report]:
    """Every rank's ``(node, value)``, in rank order (``collective`` runs the all-gather
    through the guard and translates its errors: ``trainer.dist.collective``)."""
    mine = torch.tensor([node, value], dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    collective("all_gather", lambda **kw: dist.all_gather(out, mine, **kw))
    return [Report(int(t[0]), int(t[1])) for t in out]


class Fitness:
    """The two checks of one resume, for a rank of node ``node``."""

    def __init__(self, node: int, device: torch.device, directory: str | None,
                 newest_seen: Callable[[], int],
                 collective: Callable[[str, Callable], None],
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.node, self.device = node, device
        self.directory = directory
        self.newest_seen = newest_seen
        self.collective = collective
        self.clock, self.sleep = clock, sleep

    def agree_newest(self) -> int:
        """The job's newest committed step (NONE: none); raises NodeUnfit / PeerUnfit when
        a node's directory does not show it."""
        have = self.newest_seen()
        reports = gather(self.node, have, self.device, self.collective)
        newest = max(r.value for r in reports)
        if not unfit_nodes(reports, newest):
            return newest
        if have < newest:
            have = self._wait_for(newest, have)
        reports = gather(self.node, have, self.device, self.collective)
        self._judge(reports, newest, lambda mine: (
            f"its checkpoint directory {self.directory or '(none set)'} shows "
            f"{'no checkpoint' if mine == NONE else f'step {mine}'} but the job's newest "
            f"committed checkpoint is step {newest}"), MOUNT_FIX)
        return newest

    def judge_loads(self, step: int, error: BaseException | None) -> None:
        """After every rank loaded ``step``: NodeUnfit / PeerUnfit if a load failed."""
        reports = gather(self.node, 0 if error is not None else 1, self.device, self.collective)
        self._judge(reports, 1, lambda _: f"it could not load checkpoint step {step} "
                                          f"from {self.directory}: {error}",
                    "check that this node reads the same files as the others (the same "
                    "mount, its permissions, the disk), then start elasticd again")

    def _wait_for(self, newest: int, have: int) -> int:
        deadline = self.clock() + VISIBLE_S
        while have < newest and self.clock() < deadline:
            self.sleep(POLL_S)
            have = self.newest_seen()
        return have

    def _judge(self, reports: Sequence[Report], wanted: int, why: Callable[[int], str],
               fix: str) -> None:
        bad = unfit_nodes(reports, wanted)
        if not bad:
            return
        if self.node in bad:
            mine = next(r.value for r in reports if r.node == self.node and r.value < wanted)
            raise NodeUnfit(f"this node (ranks from {self.node}) cannot resume the job: "
                            f"{why(mine)}. Fix: {fix}; the other nodes go on without it")
        raise PeerUnfit(f"the node(s) with first rank {sorted(bad)} cannot resume the job "
                        "(their daemons leave it); restarting without them")


__all__ = ["NONE", "VISIBLE_S", "Fitness", "NodeUnfit", "PeerUnfit", "Report", "gather",
           "unfit_nodes"]
