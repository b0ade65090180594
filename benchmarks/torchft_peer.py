"""One torchft replica training a thinwire workload: issue 21's torchft peer (its LocalSGD and DiLoCo).

torchft (https://github.com/pytorch/torchft, ``pip install torchft``, 0.2.0) runs each replica group
under a ``Manager`` that asks a lighthouse for a quorum and averages over its own fault-tolerant
process group (``ProcessGroupGloo`` here). Its ``LocalSGD`` averages the parameters every
``sync_every`` optimizer steps; its ``DiLoCo`` averages the pseudo-gradient (the last global
parameters minus the local ones) every ``sync_every`` inner steps and applies it with an outer
optimizer (the paper's and torchft's tests': SGD, lr 0.7, Nesterov momentum 0.9). Both run as
context managers around the inner optimizer, as torchft's own examples do.

Here each emulated host is one replica group of one process (its own ``TCPStore`` and manager
server at the host's address); rank 0 also runs the lighthouse, with ``min_replicas`` = every host,
so no step trains with a partial quorum; the quorum is asynchronous for LocalSGD (torchft's default) and
synchronous for DiLoCo (which requires it). ``init_sync=False``: every replica seeds the same initial
weights (torchft's documented setting for that case). The model, data, validation subset, AdamW settings, warm-up
+ cosine schedule and gradient clipping are thinwire's (``thinwire train``'s sampler slices the same
global draw), so a run here and a ``thinwire train`` run differ only in how the hosts communicate.

Validation happens right after an average, where every replica holds the same model (the model a
run stands for, as ``thinwire train`` validates the ranks' average, its ``local`` and ``diloco`` at
the same steps): at the first sync step at or after each ``--eval-every`` mark and at the last step (which must be a sync step). Each replica
validates every world-th item of the subset, as ``thinwire train``'s ranks do, and writes its sums to
``RUN_DIR/peerR.jsonl`` with its step records (``step_time_s``, ``compute_s``, ``comm_wait_s``: the
time in torchft's hook, quorum included, ``bytes_sent`` by the ring all-reduce's formula); the
harness (``benchmarks/compare.py``) merges the ranks.

    python benchmarks/torchft_peer.py --rank 0 --world 4 --ip 127.0.0.1 --run-dir /tmp/tf --mode localsgd --period 16
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hivemind_peer import _barrier, _num, val_sums  # noqa: E402  (the harness's barrier, options, validation)

LIGHTHOUSE_PORT = 29600
STORE_PORT, MANAGER_PORT = 29610, 29611  # plus 10 x rank: replicas may share one address (loopback)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ip", required=True, help="the address this replica listens on")
    ap.add_argument("--lighthouse", help="rank 0's address (the lighthouse's); default: --ip")
    ap.add_argument("--run-dir", required=True, help="a folder every replica can write")
    ap.add_argument("--mode", choices=["localsgd", "diloco"], required=True)
    ap.add_argument("--period", type=int, default=16, help="sync_every: steps between averages")
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--outer-momentum", type=float, default=0.9)
    ap.add_argument("--workload", default="charlm")
    ap.add_argument("--set", action="append", default=[], help="model.KEY=VALUE, as thinwire train takes it")
    ap.add_argument("--steps", type=int, default=480)
    ap.add_argument("--batch-size", type=int, default=32, help="global batch: each replica takes batch / world per step")
    ap.add_argument("--lr", type=float, help="peak learning rate (default: the workload's)")
    ap.add_argument("--warmup-steps", type=int, help="default: thinwire train's")
    ap.add_argument("--eval-every", type=int, default=24)
    ap.add_argument("--eval-batches", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps % args.period:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --period {args.period} (the last step validates an average)")

    import torch
    from torch.distributed import TCPStore
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    from thinwire.train.config import TrainConfig
    from thinwire.workloads.base import GlobalSampler, collate, eval_subset
    from thinwire.workloads.registry import build_workload

    torch.set_num_threads(1)
    model_opts = {k.removeprefix("model."): _num(v) for k, _, v in (s.partition("=") for s in args.set)}
    torch.manual_seed(args.seed)  # identical initial weights on every replica, as thinwire's trainer seeds them
    wl = build_workload(args.workload, model_opts, None)
    cfg = TrainConfig()
    lr = args.lr or wl.lr
    warm = cfg.warmup_steps if args.warmup_steps is None else args.warmup_steps
    torch.manual_seed(args.seed * 1000 + args.rank + 1)
    model = wl.model
    inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    run_dir = Path(args.run_dir)

    lighthouse = None
    if args.rank == 0:
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind=f"{args.ip}:{LIGHTHOUSE_PORT}", min_replicas=args.world)
    store = TCPStore(args.ip, STORE_PORT + 10 * args.rank, is_master=True, wait_for_workers=False)  # this replica group's store
    state = {}
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)), min_replica_size=args.world,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
        state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
        # torchft's default (asynchronous) quorum where the algorithm allows it; DiLoCo requires a synchronous one
        use_async_quorum=args.mode == "localsgd", replica_id=f"replica{args.rank}", store_addr=args.ip, store_port=STORE_PORT + 10 * args.rank,
        rank=0, world_size=1, lighthouse_addr=f"http://{args.lighthouse or args.ip}:{LIGHTHOUSE_PORT}",
        hostname=args.ip, port=MANAGER_PORT + 10 * args.rank, timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=120),
        connect_timeout=timedelta(seconds=120),
        # identical initial weights (seeded): torchft's documented setting; with True a replica would heal from
        # replica 0's checkpoint server at step 0, which advertises socket.gethostname(), not the host's address
        init_sync=False)
    if args.mode == "localsgd":
        algo = LocalSGD(manager, model, inner, sync_every=args.period)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True)
        algo = DiLoCo(manager, [model], inner, outer, sync_every=args.period, pin_memory=False)
    # registered before torchft's own post hook, so it marks the end of the inner step
    inner.register_step_post_hook(lambda *_: state.__setitem__("stepped", time.perf_counter()))

    params = sum(p.numel() for p in model.parameters())
    ring_bytes = int(2 * (args.world - 1) / args.world * 4 * params)  # fp32 ring all-reduce, per replica
    _barrier(run_dir, "ready", args.rank, args.world)
    sampler = GlobalSampler(len(wl.train), args.batch_size, args.seed)
    evals = eval_subset(len(wl.val), args.eval_batches, args.batch_size)[args.rank::args.world]
    local = args.batch_size // args.world
    out = (run_dir / f"peer{args.rank}.jsonl").open("w")
    t0 = time.perf_counter()
    eval_s = 0.0
    next_eval = args.eval_every
    with algo:
        for step in range(args.steps):
            ts = time.perf_counter()
            factor = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (
                1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, args.steps - warm))))
            for g in inner.param_groups:
                g["lr"] = lr * factor
            x, y = collate(wl.train, sampler.global_indices(step)[args.rank * local:(args.rank + 1) * local])
            model.train()
            loss = wl.loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            inner.step()  # torchft's hook averages here every period-th step
            te = time.perf_counter()
            inner.zero_grad(set_to_none=True)
            synced = (step + 1) % args.period == 0
            rec = {"step": step + 1, "step_time_s": te - ts, "compute_s": state["stepped"] - ts,
                   "comm_wait_s": te - state["stepped"], "bytes_sent": ring_bytes if synced else 0,
                   "loss": float(loss.detach())}
            out.write(json.dumps(rec) + "\n")
            if synced and (step + 1 >= next_eval or step + 1 == args.steps):
                te0 = time.perf_counter()
                total, count = val_sums(wl, model, evals, local)
                model.train()
                eval_s += time.perf_counter() - te0
                out.write(json.dumps({"step": step + 1, "samples": (step + 1) * args.batch_size,
                                      "wall_s": time.perf_counter() - t0, "eval_s": eval_s,
                                      "val_sum": total, "val_count": count,  # the harness checks the replicas agree:
                                      "param_sum": float(sum(p.double().sum() for p in model.parameters()))}) + "\n")
                while next_eval <= step + 1:
                    next_eval += args.eval_every
            out.flush()
    out.close()
    _barrier(run_dir, "done", args.rank, args.world, timeout=60.0, must=False)  # others may still average with us
    manager.shutdown(wait=False)
    del store  # this replica group's store served the manager until here
    if lighthouse is not None:
        lighthouse.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
