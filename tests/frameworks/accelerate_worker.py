"""accelerate worker for tests/test_frameworks.py (torchrun --nproc-per-node 2): trains ``--steps``
steps with thinwire attached to the prepared model, saves step 0's averaged gradient, then
``accelerator.save_state``; with ``--resume DIR`` loads that state first and saves the hook's state
right after loading."""

import argparse
import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

from thinwire.integrations.accelerate import attach  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    net = common.make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = accelerator.prepare(net, opt)
    comm = attach(accelerator, model, a.codec)
    if a.resume:
        accelerator.load_state(a.resume)
        if comm is not None:  # None on one process: nothing attached
            torch.save(comm.state_dict(), f"{a.out}/start_state_rank{rank}.pt")
    for step in range(a.steps):
        x, y = common.batch(rank, step)
        opt.zero_grad()
        accelerator.backward(common.loss_fn(model, x, y))
        if step == 0:
            torch.save(common.grads(getattr(model, "module", model)), f"{a.out}/grads_rank{rank}.pt")
        opt.step()
    accelerator.save_state(f"{a.out}/state")
    if comm is not None:
        torch.save({"state": comm.state_dict(), "stats": comm.stats()}, f"{a.out}/end_rank{rank}.pt")
    accelerator.wait_for_everyone()  # leave together: gloo torn down while a peer still talks aborts
    accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
