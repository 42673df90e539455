"""ddp_plain.py converted to elasticd: the diff is in docs/trainer.md ("Migrating").

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        trainer/examples/ddp_elastic.py --epochs 3 --checkpoint-dir /tmp/ckpt

What it gains: it resumes at the exact sample and step (not the last epoch's end) from
atomic, verified checkpoints on the daemon's cadence; every sample once per epoch
across world-size changes; the LR rescaled to the world size beneath its scheduler;
a coordinated stop on SIGTERM or a drain, committed at an agreed step.
"""

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from trainer import ElasticDistributedSampler, ElasticState, exit_worker
from trainer.examples import common, regression


def main() -> None:
    args = regression.arguments(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    dataset = regression.make_dataset(args)
    sampler = ElasticDistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    model = DDP(regression.make_model(args))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = regression.warmup_cosine(optimizer, args)
    state = ElasticState(model, optimizer, loader=loader, scheduler=scheduler,
                         ctx=common.context(args), log_every=args.log_every)
    for epoch in range(state.epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step_done(loss)
            time.sleep(args.step_sleep)
        # One write() for the whole line: print() writes the newline separately, and
        # the ranks share one log, where a peer's JSON line could land between the two.
        print(f"epoch {epoch} done\n", end="", flush=True)
    exit_worker(state.finish())


if __name__ == "__main__":
    main()
