"""A plain PyTorch DDP script with a thinwire sync mode: when gradients or parameters are averaged.

    torchrun --nproc-per-node 2 examples/sync_modes.py --sync delayed --codec int8
    torchrun --nproc-per-node 2 examples/sync_modes.py --sync local:period=8,warmup=20 --codec int8
    torchrun --nproc-per-node 2 examples/sync_modes.py --sync diloco:period=16 --codec int8
    torchrun --nproc-per-node 2 examples/sync_modes.py --sync diloco:period=16,fragments=2 --codec int8
    torchrun --nproc-per-node 2 examples/sync_modes.py --sync gossip:topology=exp2,overlap=1 --codec int8
    torchrun --nproc-per-node 2 examples/sync_modes.py --sync dynamic:threshold=0.05 --codec int8

Four lines differ from the usual DDP recipe (marked <-); the last, evaluating the ranks' average, matters
only for the modes whose ranks differ between averages.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sync", default="delayed", help="allreduce, delayed, local:period=H, diloco:period=H, gossip, dynamic")
    ap.add_argument("--codec", default="int8", help="thinwire codec spec, e.g. topk:ratio=0.01")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    mode = thinwire.sync(model, args.sync, codec=args.codec, optimizer=opt)  # <- the mode

    g = torch.Generator().manual_seed(1234 + rank)                        # each rank its own data
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        opt.zero_grad()
        with mode.no_sync():                                                # <- the mode averages, not DDP
            nn.functional.mse_loss(model(x), x @ w_true).backward()
        mode.step(opt)                                                      # <- instead of opt.step()
    with mode.consensus(), torch.no_grad():                                 # <- the ranks' average (local, gossip, ...)
        x = torch.randn(256, 32, generator=torch.Generator().manual_seed(99))
        loss = nn.functional.mse_loss(model(x), x @ w_true)
    if rank == 0:
        s = mode.comm.stats()
        print(f"{args.sync}: held-out loss {loss.item():.4f} of the ranks' average; {s['bytes_sent'] / 1e6:.2f} MB sent "
              f"({args.codec}); world {world}")
    mode.close()
    dist.barrier()  # leave together: gloo torn down while a peer still talks can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
