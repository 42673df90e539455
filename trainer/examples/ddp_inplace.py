"""ddp_elastic.py with in-place recovery: the loop moves into a function that
``ElasticState.run`` calls (again, with the new group's model, after a re-form).

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        trainer/examples/ddp_inplace.py --epochs 3 --checkpoint-dir /tmp/ckpt

What it gains over ddp_elastic.py, under elasticd's daemons in ``[recovery] mode =
"in-place"``: when a peer is lost the survivors keep their processes and state and go on
in the smaller world within about a second (no restart, no checkpoint load, 0 steps
lost, whichever node was lost); joins and fallbacks still take the restart path.
"""

import time

import torch
import torch.distributed as dist
from torch import nn
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
    model = regression.make_model(args)  # no DDP here: state.run wraps it for each group
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = regression.warmup_cosine(optimizer, args)
    state = ElasticState(model, optimizer, loader=loader, scheduler=scheduler,
                         ctx=common.context(args), log_every=args.log_every)

    def train(ddp: nn.Module) -> None:
        for epoch in range(state.epoch, args.epochs):
            sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(ddp(x), y)
                loss.backward()
                optimizer.step()
                scheduler.step()
                state.step_done(loss)
                time.sleep(args.step_sleep)
            # One write() for the whole line: print() writes the newline separately, and
            # the ranks share one log, where a peer's JSON line could land between the two.
            print(f"epoch {epoch} done\n", end="", flush=True)

    exit_worker(state.run(train))


if __name__ == "__main__":
    main()
