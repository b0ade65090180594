"""One hivemind peer training a thinwire workload: issue 22's peer, as hivemind's own quick start runs it.

hivemind (https://github.com/learning-at-home/hivemind, ``pip install hivemind``) trains over a DHT
of peers, without a rendezvous: ``hivemind.Optimizer`` with ``use_local_updates=True`` (the quick
start's mode) applies every local step at once and averages the peers' parameters and optimizer
state in the background each time the collaboration has processed ``target_batch_size`` samples (an
"epoch"; 4096 and a 3 s matchmaking time, 10 s averaging timeout as in its quick start), so a slow peer delays nobody; gradients never travel. The model, data, validation subset,
AdamW settings, warm-up + cosine schedule and gradient clipping are thinwire's (the workload's
defaults), so a run here and a ``thinwire train`` run differ only in how the hosts communicate.

Rank 0 starts the DHT and writes its address to ``RUN_DIR/peers.txt``; the other ranks join through
it. Every peer trains its ``world``-th share of each global batch (iid: slices of the same global
draw as ``thinwire train``'s sampler) for ``--steps`` local steps, so the collaboration processes
the samples of ``--steps`` global steps. The peers start training together (a file barrier in ``RUN_DIR``,
the harness's, as ranks start after a rendezvous) and wait up to a minute for each other at the end. Rank 0 evaluates every ``--eval-every`` local steps and
writes ``RUN_DIR/metrics.jsonl`` (``step``, ``val_loss``, ``wall_s`` from its first step, ``epoch``).

    python benchmarks/hivemind_peer.py --rank 0 --world 4 --ip 127.0.0.1 --run-dir /tmp/hm --steps 300
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--ip", required=True, help="the address this peer listens on")
    ap.add_argument("--run-dir", required=True, help="a folder every peer can read (rank 0 writes peers.txt there)")
    ap.add_argument("--workload", default="digits")
    ap.add_argument("--set", action="append", default=[], help="model.KEY=VALUE, as thinwire train takes it")
    ap.add_argument("--steps", type=int, default=300, help="local steps per peer (= global steps of the collaboration)")
    ap.add_argument("--batch-size", type=int, default=64, help="global batch: each peer takes batch / world per step")
    ap.add_argument("--target-batch-size", type=int, default=4096,
                    help="samples of the collaboration per hivemind epoch (an average): hivemind's quick start, 4096")
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--eval-batches", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--matchmaking-time", type=float, default=3.0, help="hivemind's quick start: 3 s")
    ap.add_argument("--averaging-timeout", type=float, default=10.0, help="hivemind's quick start: 10 s")
    ap.add_argument("--verbose", action="store_true", help="hivemind's progress log (epochs, averaging rounds)")
    args = ap.parse_args()

    import torch
    import hivemind

    from thinwire.train.config import TrainConfig
    from thinwire.workloads.base import GlobalSampler, collate, eval_subset
    from thinwire.workloads.registry import build_workload

    torch.set_num_threads(1)
    model_opts = {k.removeprefix("model."): v for k, _, v in (s.partition("=") for s in args.set)}
    torch.manual_seed(args.seed)  # identical initial weights on every peer, as thinwire's trainer seeds them
    wl = build_workload(args.workload, {k: _num(v) for k, v in model_opts.items()}, None)
    cfg = TrainConfig()  # the trainer's defaults: AdamW weight decay, warm-up, cosine, clipping
    torch.manual_seed(args.seed * 1000 + args.rank + 1)  # per-peer randomness, as the trainer's ranks have
    model = wl.model
    run_dir = Path(args.run_dir)
    peers_file = run_dir / "peers.txt"
    if args.rank == 0:
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.ip}/tcp/0"], start=True)
        tmp = peers_file.with_suffix(".tmp")
        tmp.write_text("\n".join(str(a) for a in dht.get_visible_maddrs()))
        tmp.replace(peers_file)
    else:
        for _ in range(600):
            if peers_file.exists():
                break
            time.sleep(0.1)
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.ip}/tcp/0"], initial_peers=peers_file.read_text().split(),
                           start=True)
    local = args.batch_size // args.world
    opt = hivemind.Optimizer(
        dht=dht, run_id=f"thinwire-{args.workload}-s{args.seed}", batch_size_per_step=local,
        target_batch_size=args.target_batch_size,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=wl.lr, weight_decay=cfg.weight_decay), params=model.parameters(),
        use_local_updates=True, matchmaking_time=args.matchmaking_time, averaging_timeout=args.averaging_timeout,
        verbose=args.verbose)
    _barrier(run_dir, "ready", args.rank, args.world)  # start training together, as ranks do after a rendezvous
    sampler = GlobalSampler(len(wl.train), args.batch_size, args.seed)
    evals = eval_subset(len(wl.val), args.eval_batches, args.batch_size)
    out = (run_dir / "metrics.jsonl").open("a") if args.rank == 0 else None
    warm = cfg.warmup_steps
    t0 = None
    for step in range(args.steps):
        factor = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (
            1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, args.steps - warm))))
        for g in opt.state_averager.optimizer.param_groups:  # opt.param_groups hands out copies
            g["lr"] = wl.lr * factor
        idx = sampler.global_indices(step)[args.rank * local:(args.rank + 1) * local]
        x, y = collate(wl.train, idx)
        model.train()
        t0 = t0 or time.perf_counter()
        loss = wl.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        if out is not None and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            wall = time.perf_counter() - t0
            out.write(json.dumps({"step": step + 1, "val_loss": _validate(wl, model, evals, args.batch_size),
                                  "wall_s": wall, "epoch": opt.local_epoch}) + "\n")
            out.flush()
    if out is not None:
        out.close()
    _barrier(run_dir, "done", args.rank, args.world, timeout=60.0, must=False)  # stay a while for others' averages
    opt.shutdown()
    dht.shutdown()
    return 0


def _barrier(run_dir: Path, name: str, rank: int, world: int, timeout: float = 600.0, must: bool = True) -> None:
    """Wait until every peer has reached ``name``: a file per peer in the shared run folder (the
    benchmark's harness on one machine, not a transport: hivemind itself needs no barrier). ``must``:
    a peer missing after ``timeout`` is an error; otherwise this peer goes on without it."""
    (run_dir / f"{name}{rank}").touch()
    deadline = time.time() + timeout
    while not all((run_dir / f"{name}{r}").exists() for r in range(world)):
        if time.time() > deadline:
            if must:
                raise SystemExit(f"peer {rank}: not every peer reached '{name}' within {timeout:.0f} s")
            return
        time.sleep(0.05)


def _num(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def _validate(wl, model, evals: list[int], batch: int) -> float:
    total, count = val_sums(wl, model, evals, batch)
    return total / max(1, count)


def val_sums(wl, model, items: list[int], per: int) -> tuple[float, int]:
    """The summed validation loss over ``items`` (``per`` a forward) and their count, in eval mode."""
    import torch

    from thinwire.workloads.base import collate

    model.eval()
    total = count = 0
    with torch.no_grad():
        for i in range(0, len(items), per):
            x, y = collate(wl.val, items[i:i + per])
            total += float(wl.loss(model(x), y)) * len(y)
            count += len(y)
    return total, count


if __name__ == "__main__":
    sys.exit(main())
