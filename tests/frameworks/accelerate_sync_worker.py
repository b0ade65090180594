"""accelerate worker for tests/test_frameworks.py (torchrun --nproc-per-node 2): a thinwire sync mode in
an accelerate loop through ``thinwire.integrations.accelerate.sync``, steps ``--first-step`` to ``--steps``
(each rank its own batches, SGD with momentum), ``accelerator.save_state`` at the end; with ``--resume
DIR`` that state is loaded first. Writes each rank's final parameters."""

import argparse
import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(__file__))
import common  # noqa: E402

from thinwire.integrations.accelerate import sync  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sync", default="local:period=3,warmup=0")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--first-step", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--accumulate", type=int, default=1, help="each step's batch as this many accumulated micro-batches")
    ap.add_argument("--save-in-consensus", action="store_true", help="save_state inside mode.consensus()")
    a = ap.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=a.accumulate)
    rank = accelerator.process_index
    net = common.make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(net, opt)
    mode = sync(accelerator, model, a.sync, a.codec, optimizer=opt)
    if a.resume:
        accelerator.load_state(a.resume)
    for step in range(a.first_step, a.steps):
        x, y = common.batch(rank, step)
        for xb, yb in zip(x.chunk(a.accumulate), y.chunk(a.accumulate)):
            with accelerator.accumulate(model):
                with mode.no_sync():
                    accelerator.backward(common.loss_fn(model, xb, yb))
                mode.step(opt)
                opt.zero_grad()
    if a.save_in_consensus:  # accelerate's model file then holds the ranks' average
        with mode.consensus():
            accelerator.save_state(f"{a.out}/state")
    else:
        accelerator.save_state(f"{a.out}/state")
    net = getattr(model, "module", model)  # one process: accelerate does not wrap it
    torch.save({"params": [p.detach().clone() for p in net.parameters()], "stats": mode.comm and mode.comm.stats()},
               f"{a.out}/end_rank{rank}.pt")
    mode.close()
    accelerator.wait_for_everyone()  # leave together: gloo torn down while a peer still talks aborts
    accelerator.end_training()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # past gloo's C++ static destructors, which can abort a finished run at exit ("terminate called ...")
