"""What ``thinwire doctor`` measures on every rank, in a few seconds each.

* **The step with and without communication**, on the workload's own model and a real batch: DDP
  fp32 steps, and the same steps inside ``no_sync()`` (DDP's reducer does not all-reduce: the step
  with communication removed, the headroom). The two kinds alternate in rounds so that a machine
  whose speed drifts affects both alike. Per rank, the DDP step is the median; the step without
  communication the lower quartile: interference (a neighbour's burst on a shared core, the tail of
  the last round's traffic) only ever slows a step down, so a low quantile is the undisturbed
  compute, as the network probes keep their fastest repetition. (On 4 emulated hosts sharing 2
  cores the no-communication steps ranged 0.17-0.93 s around a median of 0.3 s, while training the
  same model with top-k, whose step is nearly all compute, ran at 0.175 s.)
* **The all-reduce**: a 4 KiB one (mostly latency; the median of ``SMALL_REPS``, as every collective
  of a step pays its hosts' hand-offs) and one of the model's gradient size (the fastest of several),
  each after a barrier; the ring model turns the two into latency (alpha) and seconds per byte
  (beta), as :mod:`thinwire.measure.network` does on the emulator.
* **Each codec, tried**: a few real steps of the same model with thinwire's hook and that codec
  (a fresh copy of the model per codec, every rank the same number of steps, about ``TRIAL_S``
  seconds each): what the codec's bytes, its CPU work and the hook's own work cost on these hosts and
  links, measured rather than modelled. On 4 emulated hosts at half a core and 1 Gbit/s the model,
  calibrated, predicted every lossy codec 12-16% faster than fp32 while each trained 6-17% slower:
  codec work on a small host costs more than its measured kernels say.
* **Every pair's point-to-point rate**: each pair of ranks exchanges a buffer both ways at once
  while the others wait, so a slow link or a slow host's NIC shows up by name.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.cluster.bench import bus_factor
from thinwire.measure.network import SMALL_BYTES, SMALL_REPS, alpha_beta
from thinwire.precision.setup import sample_from
from thinwire.workloads.base import collate

ROUNDS, STEPS_PER_ROUND, WARMUP = 3, 4, 2
TRIAL_S, TRIAL_STEPS = 3.0, (3, 8)   # seconds per codec trial; fewest and most timed steps
P2P_MAX_BYTES = 4 * 2**20


def steps(model: DistributedDataParallel, loss_fn, opt, batch, *, n: int, sync: bool) -> list[float]:
    """Seconds of ``n`` training steps (forward, backward, optimizer), communicating or not."""
    x, y = batch
    device = next(model.parameters()).device
    out = []
    for _ in range(n):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if sync:
            loss_fn(model(x), y).backward()
        else:
            with model.no_sync():
                loss_fn(model(x), y).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - start)
    return out


def step_times(wl, device, per_rank_batch: int, *, bucket_mb: float, seed: int) -> dict:
    """Median step with DDP fp32 and with communication removed (module docstring)."""
    model = DistributedDataParallel(wl.model.to(device), bucket_cap_mb=bucket_mb,
                                    device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)  # the optimizer's work; the weights barely move
    batch = sample_from(wl.train, collate, device, seed + dist.get_rank())(per_rank_batch)
    steps(model, wl.loss, opt, batch, n=WARMUP, sync=True)
    floor, ddp = [], []
    for _ in range(ROUNDS):
        floor += steps(model, wl.loss, opt, batch, n=STEPS_PER_ROUND, sync=False)
        dist.barrier()  # the DDP steps start together, as in training
        ddp += steps(model, wl.loss, opt, batch, n=STEPS_PER_ROUND, sync=True)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    return {"floor_s": statistics.quantiles(floor, n=4)[0], "ddp_s": statistics.median(ddp), "grad_bytes": grad_bytes,
            "floor_all_s": floor, "ddp_all_s": ddp}


def allreduce(large_bytes: int, device, reps: int = 3) -> dict:
    """Alpha and beta of the ring all-reduce over every rank (module docstring)."""
    p = dist.get_world_size()
    sizes = [SMALL_BYTES, max(large_bytes, 16 * SMALL_BYTES)]
    times = []
    for n in sizes:
        buf = torch.zeros(n // 4, device=device)
        small = n == SMALL_BYTES  # latency: the median of many (thinwire.measure.network); bandwidth: the fastest
        got = []
        for _ in range(max(reps, SMALL_REPS) if small else reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            if buf.is_cuda:
                torch.cuda.synchronize(device)
            got.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(got) if small else min(got)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
        times.append(float(t))
    if p == 1:
        return {"alpha_s": 0.0, "beta_s_per_byte": 0.0, "bus_bps": None, "sizes": sizes, "times_s": times}
    alpha, beta = alpha_beta(sizes, times, p)
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "bus_bps": 8 / beta, "sizes": sizes, "times_s": times,
            "bus_factor": bus_factor(p)}


def pairs(nbytes: int, device, reps: int = 2) -> list[dict]:
    """Each pair's rate with both directions at once (bits/s of one direction), every rank in turn."""
    p, rank = dist.get_world_size(), dist.get_rank()
    nbytes = max(SMALL_BYTES, min(nbytes, P2P_MAX_BYTES))
    send = torch.zeros(nbytes // 4, device=device)
    recv = torch.empty_like(send)
    out = []
    for a in range(p):
        for b in range(a + 1, p):
            best = float("inf")
            for _ in range(reps):
                dist.barrier()
                if rank in (a, b):
                    peer = b if rank == a else a
                    start = time.perf_counter()
                    for w in (dist.isend(send, peer), dist.irecv(recv, peer)):
                        w.wait()
                    best = min(best, time.perf_counter() - start)
            t = torch.tensor([best if rank in (a, b) else 0.0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append({"a": a, "b": b, "bytes": nbytes, "seconds": float(t), "bps": nbytes * 8 / float(t)})
    return out


def codec_trials(make_model, loss_fn, batch, codecs, device, *, bucket_mb: float,
                 timeout_s: float = 300.0) -> dict[str, float]:
    """This rank's median step with thinwire's hook and each codec (module docstring); ``CODEC@switch``:
    that codec summed by the aggregator on the switch (its address in the environment, as ``thinwire train
    --aggregation switch`` has it; one group with it per such trial)."""
    import gc

    from thinwire.api import attach
    from thinwire.compress.schemes.switched import base_spec
    from thinwire.compress.switch import connect

    out = {}
    switched = 0
    for codec in codecs:
        model = DistributedDataParallel(make_model().to(device), bucket_cap_mb=bucket_mb,
                                        device_ids=[device.index] if device.type == "cuda" else None)
        comm = attach(model, base_spec(codec))
        if codec != base_spec(codec):
            comm.switch = connect(dist.get_rank(), dist.get_world_size(), switched, timeout_s)
            switched += 1
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        first = steps(model, loss_fn, opt, batch, n=WARMUP, sync=True)
        slowest = torch.tensor([max(first[-1], 1e-4)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # every rank takes the same number of steps
        n = int(min(TRIAL_STEPS[1], max(TRIAL_STEPS[0], TRIAL_S / float(slowest))))
        dist.barrier()
        out[codec] = statistics.median(steps(model, loss_fn, opt, batch, n=n, sync=True))
        comm.close()
        del model, opt, comm
        gc.collect()
    return out
