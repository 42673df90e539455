"""Two ranks whose states differ by one step meet in a new group: the holder's state wins.

Run as ``python handover.py OUT [joined]`` with RANK/WORLD_SIZE/MASTER_* set: both ranks
build the MLP trainer and its group; rank 1 then takes one optimizer step alone (what a
survivor whose all-reduce completed does while the other's failed); both run the
trainer's hand-over and write what they hold to ``OUT.<rank>.json``. With ``joined``, the
record names rank 1's node among the joined: its newer claim must not be taken (a process
posing as a newcomer, issue 27), and rank 0's state wins. With ``ELASTICD_SECRET_FILE``
set, the members prove the job's secret first; a rank that cannot writes the error to
``OUT.<rank>.json`` instead.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from elasticd.contract.generation import GenerationId, GenerationRecord, renumber
from trainer import dist as tdist
from trainer.context import ElasticContext
from trainer.examples import mlp
from trainer.exitcodes import exit_worker
from trainer.inplace import ReformError
from trainer.loop import ElasticTrainer, TrainConfig


def main(out: str, joined: bool) -> int:
    ctx = ElasticContext.from_env()
    torch.manual_seed(0)
    x, y = mlp.make_data(64, 1, torch.float64)
    model = mlp.make_model(torch.float64)
    opt = mlp.make_optimizer(model, 0.05, 0.9)
    trainer = ElasticTrainer(model, opt, 64, lambda i: (x[i], y[i]), mlp.per_sample_loss,
                             TrainConfig(micro_batch=4, max_steps=10), ctx=ctx)
    trainer._setup()
    st = trainer.state
    if ctx.rank == 1:  # one step ahead, taken alone on its whole global batch
        idx = st.sampler.next_indices(trainer.plan.global_batch)
        opt.zero_grad()
        mlp.per_sample_loss(model, (x[idx], y[idx])).mean().backward()
        opt.step()
        st.sampler.advance(len(idx))
        st.step += 1
        st.lrs_used = [0.05]
    record = GenerationRecord(GenerationId(0, 1), renumber([("n0", 1), ("n1", 1)]),
                              "127.0.0.1:1", planned=True, joined=("n1",) if joined else ())
    try:
        trainer.recovery._sync_state(record)
    except ReformError as exc:
        with open(f"{out}.{ctx.rank}.json", "w") as f:
            json.dump({"error": str(exc)}, f)
        return 0
    digest = hashlib.sha256()
    for t in [*model.state_dict().values(), *[v for s in opt.state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor)]]:
        digest.update(t.detach().numpy().tobytes())
    with open(f"{out}.{ctx.rank}.json", "w") as f:
        json.dump({"step": st.step, "cursor": st.sampler.cursor, "digest": digest.hexdigest(),
                   "lrs_used": st.lrs_used}, f)
    tdist.shutdown(trainer.ddp)
    return 0


if __name__ == "__main__":
    exit_worker(main(sys.argv[1], sys.argv[2:] == ["joined"]))
