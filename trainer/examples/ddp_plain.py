"""A hand-written DDP job as the tutorials teach it (see ddp_elastic.py for it converted).

    python -m torch.distributed.run --standalone --nproc-per-node=2 \\
        trainer/examples/ddp_plain.py --epochs 3 --snapshot /tmp/snapshot.pt

DataLoader + DistributedSampler, Adam, a warm-up + cosine LR schedule, a rank-0
snapshot at the end of every epoch and a resume from it at start. It knows nothing
of elasticd and runs under it unchanged: after a fault the daemon restarts it and it
resumes from its last snapshot (the epoch in progress is done again).
"""

import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from trainer.examples import regression


def main() -> None:
    args = regression.arguments(__doc__.splitlines()[0])
    dist.init_process_group("gloo")
    dataset = regression.make_dataset(args)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler,
                        num_workers=args.workers)
    model = DDP(regression.make_model(args))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = regression.warmup_cosine(optimizer, args)
    start_epoch = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot, weights_only=True)
        model.module.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        scheduler.load_state_dict(snapshot["scheduler"])
        start_epoch = snapshot["epoch"] + 1
        print(f"resumed from {args.snapshot} at epoch {start_epoch}", flush=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
            time.sleep(args.step_sleep)
        if dist.get_rank() == 0 and args.snapshot:
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "epoch": epoch}, args.snapshot)
        print(f"epoch {epoch} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
