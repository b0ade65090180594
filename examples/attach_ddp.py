"""A plain PyTorch DDP script with thinwire's compressed all-reduce attached in one line.

    torchrun --nproc-per-node 2 examples/attach_ddp.py --codec int8

Nothing else in the script knows about thinwire: it is the usual DDP recipe.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import thinwire


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8", help="thinwire codec spec, e.g. topk:ratio=0.01")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)))
    state = thinwire.attach(model, args.codec, error_feedback=True)          # <- the one line
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1234 + rank)                        # each rank its own data
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(0))
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x @ w_true)
        opt.zero_grad()
        loss.backward()                                                     # averaged via the codec
        opt.step()
    if rank == 0:
        s = state.stats()
        print(f"final loss {loss.item():.4f}; {s['bytes_sent'] / 1e6:.2f} MB sent for {s['bytes_raw'] / 1e6:.2f} MB "
              f"of gradients ({args.codec}); world {world}")
    state.close()
    dist.barrier()  # leave together: gloo torn down while a peer still talks can abort
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
