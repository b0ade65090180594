"""Measure a workload's training step on this machine, as the trainer runs it, on one rank.

The model is wrapped in DDP on a one-process gloo group with the trainer's bucket cap, so the
step includes DDP's own work (copying gradients into buckets and back) and DDP's real bucket layout
(after its rebuild at the second step) is observed. A communication hook that returns at once
records when each bucket is handed over: with nothing to wait for, that is when its last gradient
was ready. Each step is timed in the trainer's phases: data + forward (``pre``), backward, gradient
clip + AdamW step + zero_grad (``post``).

FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` over one forward + backward; the bytes
autograd saves for backward (activations) from ``torch.autograd.graph.saved_tensors_hooks``.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from thinwire.measure.file import BucketRecord, ComputePoint
from thinwire.workloads.base import GlobalSampler, collate


@contextmanager
def single_process_group():
    """A one-rank gloo group (the caller's own if one exists)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class BucketRecorder:
    """A DDP comm hook that completes at once and notes each bucket's layout and hand-over time."""

    def __init__(self, param_index: dict[int, int]) -> None:
        self.param_index = param_index
        self.calls: list[tuple[float, int, int, list[int], list[list[int]]]] = []
        self.keep_gradients = False
        self.gradients: list = []  # with keep_gradients: each bucket's gradient, in the order reduced

    def hook(self, bucket):  # no annotations: DDP rejects string annotations
        if self.keep_gradients:
            self.gradients.append(bucket.buffer().detach().float().clone())
        params = bucket.parameters()
        self.calls.append((time.perf_counter(), bucket.index(), bucket.buffer().numel(),
                           [self.param_index[id(p)] for p in params], [list(p.shape) for p in params]))
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut


class StepTimer:
    """Runs training steps of ``workload`` at a per-rank batch size and times their phases."""

    def __init__(self, workload, *, bucket_mb: float, lr: float, seed: int = 0) -> None:
        self.wl = workload
        model = workload.model
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        self.recorder = BucketRecorder({id(p): i for i, p in enumerate(model.parameters())})
        self.ddp.register_comm_hook(self.recorder, BucketRecorder.hook)
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.seed, self.step_no = seed, 0

    def step(self, batch: int) -> tuple[float, float, float, float, float]:
        """(pre, forward, backward, post, backward start) of one step in seconds."""
        sampler = GlobalSampler(len(self.wl.train), batch, self.seed)
        t0 = time.perf_counter()
        x, y = collate(self.wl.train, sampler.global_indices(self.step_no))
        t1 = time.perf_counter()
        loss = self.wl.loss(self.ddp(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        self.step_no += 1
        return t2 - t0, t2 - t1, t3 - t2, t4 - t3, t2

    def measure(self, batch: int, *, warmup: int, reps: int) -> tuple[ComputePoint, list[BucketRecord]]:
        """Median phases over ``reps`` steps after ``warmup``; the bucket layout of the last step."""
        for _ in range(warmup):
            self.step(batch)
        rows, fracs = [], []
        for _ in range(reps):
            self.recorder.calls.clear()
            pre, fwd, bwd, post, t_bwd = self.step(batch)
            rows.append((pre, fwd, bwd, post))
            fracs.append([min(1.0, (c[0] - t_bwd) / bwd) for c in self.recorder.calls])
        med = [statistics.median(col) for col in zip(*rows)]
        totals = [sum(r) - r[1] for r in rows]  # pre already holds forward
        std = robust_std(totals)
        point = ComputePoint(batch=batch, pre_s=med[0], forward_s=med[1], backward_s=med[2], post_s=med[3], std_s=std)
        ready = [statistics.median(col) for col in zip(*fracs)]
        buckets = [BucketRecord(numel=c[2], ready_frac=r, params=c[3], shapes=c[4])
                   for c, r in zip(self.recorder.calls, ready)]
        return point, buckets


def step_gradients(timer: StepTimer, batch: int, steps: int) -> list[list]:
    """The flat bucket gradients of ``steps`` further training steps at ``batch`` (one list per step)."""
    out = []
    timer.recorder.keep_gradients = True
    try:
        for _ in range(steps):
            timer.recorder.gradients = []
            timer.step(batch)
            out.append(timer.recorder.gradients)
    finally:
        timer.recorder.keep_gradients, timer.recorder.gradients = False, []
    return out


def robust_std(xs: list[float]) -> float:
    """1.4826 x the median absolute deviation: the standard deviation of the step's own noise, not of
    the rare step another process on the machine interrupted (which a plain stdev would count)."""
    if len(xs) < 2:
        return 0.0
    med = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - med) for x in xs)


def count_flops(workload, batch: int) -> float:
    """FLOPs of one forward + backward at ``batch`` (FlopCounterMode; matmuls and convolutions)."""
    from torch.utils.flop_counter import FlopCounterMode

    x, y = collate(workload.train, list(range(batch)))
    counter = FlopCounterMode(display=False)
    with counter:
        workload.loss(workload.model(x), y).backward()
    workload.model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def activation_bytes(workload, batch: int) -> int:
    """Bytes of distinct tensors autograd saves for backward in one forward at ``batch``."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    x, y = collate(workload.train, list(range(batch)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = workload.loss(workload.model(x), y)
    params = {p.untyped_storage().data_ptr() for p in workload.model.parameters()}
    del loss
    return sum(n for (ptr, _), n in seen.items() if ptr not in params)
