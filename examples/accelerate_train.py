"""Hugging Face accelerate with thinwire: the digits classifier, gradients int8 on the wire, or a sync
mode (local SGD, DiLoCo) in the same loop.

    torchrun --nproc-per-node 2 examples/accelerate_train.py --codec int8
    torchrun --nproc-per-node 2 examples/accelerate_train.py --codec int8 --sync local:period=4
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py   # on CPUs too; with --cpu
                                                   # accelerate starts one process, and nothing is averaged

Needs ``pip install 'thinwire[accelerate]'``. thinwire adds one line after ``accelerator.prepare``
(two more for a sync mode: forward and backward in ``mode.no_sync()``, and ``mode.step(optimizer)``).
"""

import argparse
import contextlib
import os
import sys

import torch
from accelerate import Accelerator
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from thinwire.integrations.accelerate import attach, sync


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8", help="thinwire codec spec (thinwire codecs lists them)")
    ap.add_argument("--sync", default=None, help="a sync mode, e.g. local:period=4 or diloco:period=50")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/accelerate", help="accelerator.save_state writes here")
    args = ap.parse_args()
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    loader = DataLoader(TensorDataset(x[:1500], y[:1500]), batch_size=32, shuffle=True)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    model, opt, loader = accelerator.prepare(net, opt, loader)
    if args.sync:                                                         # <- thinwire (a sync mode; save_state keeps
        mode = sync(accelerator, model, args.sync, args.codec, optimizer=opt)  #    every rank's own state)
        comm = mode.comm
    else:
        mode, comm = None, attach(accelerator, model, args.codec)         # <- thinwire (the hook)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            opt.zero_grad()
            if mode is None:
                accelerator.backward(nn.functional.cross_entropy(model(xb), yb))
                opt.step()
            else:
                with mode.no_sync():  # forward and backward: DDP decides at the forward whether to all-reduce
                    accelerator.backward(nn.functional.cross_entropy(model(xb), yb))
                mode.step(opt)
            step += 1
            if step == args.steps:
                break
    accelerator.save_state(args.out)  # every rank's residuals (and a sync mode's state) with it
    with (mode.consensus() if mode is not None else contextlib.nullcontext()), torch.no_grad():  # the ranks' average
        acc = (model(x[1500:].to(accelerator.device)).argmax(1).cpu() == y[1500:]).float().mean()
    if accelerator.is_main_process and comm is not None:
        s = comm.stats()
        print(f"val accuracy {acc:.3f}; {s['bytes_sent'] / 1e6:.2f} MB sent for {s['bytes_raw'] / 1e6:.2f} MB "
              f"averaged ({args.codec}{', ' + args.sync if args.sync else ''}); world {accelerator.num_processes}")
    accelerator.wait_for_everyone()  # leave together: gloo torn down while a peer still talks can abort
    accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
