"""The agreement of measurements across ranks: one all-reduce makes every input of a decision identical.

Each rank measures its own link, compute, codec costs, errors and step times (:mod:`.meters`,
:mod:`.shadow`). At a check, right after the step's first bucket has gone out, on the thread that sent
it (all ranks reach it in the same place of the same collective sequence), :func:`agree_async` packs a rank's
:class:`Measurements` into one float64 tensor and all-reduces it with MAX: the slowest rank's
compute, codec costs, errors and step times, and the fastest rank's transfer time per byte, around
the ring and through the switch (those entries are negated, so MAX gives the MIN: the others' include
waiting for late peers). From then on
every rank decides from the same record, so every rank decides the same.

The all-reduce is issued asynchronously behind a check's first bucket and waited for at the next
step's (:func:`agree_async`), so every rank decides one step after it measured.

Cost: one all-reduce of ``6 + 2 c + b (1 + l) + w`` float64 values (``c`` compressing candidates,
``b`` buckets, ``l`` lossy candidates, ``w`` steps of a window) per check.

    >>> m = Measurements(alpha=1e-4, beta=8e-9, pre_s=0.02, backward_s=0.04, step_s=0.1, errors={0: 0.01},
    ...                  shadow={0: {"int8": 0.008}}, window=[0.1, 0.11], costs={"int8": (1e-9, 1e-9)})
    >>> agree_async(m, window=3, group=None, world=1)() == m
    True
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Measurements:
    """One rank's measurements over a window, or (after :func:`agree_async`) every rank's merged."""

    alpha: float                          # seconds per message
    beta: float                           # seconds per byte
    pre_s: float                          # forward start -> first gradient
    backward_s: float                     # first -> last gradient
    step_s: float                         # median step of the window
    errors: dict[int, float]              # bucket -> its codec's error with error feedback, in use
    shadow: dict[int, dict[str, float]]   # bucket -> lossy candidate -> its error in shadow (warm-up)
    window: list[float]                   # the window's step times
    costs: dict[str, tuple[float, float]] = dataclasses.field(default_factory=dict)  # spec -> encode, decode s/byte
    switch_beta: float | None = None      # through the switch: its pace (meters.LinkMeter.switch_estimate)


def agree_async(local: Measurements, *, window: int, group, world: int) -> Callable[[], Measurements]:
    """Every rank's ``local`` merged with one MAX all-reduce (see the module docstring), issued now,
    asynchronously: returns the function that waits for it and gives the merged record. ``window``:
    how many step times each rank contributes (the last ones, padded). Issued behind the step's first
    bucket (:meth:`~thinwire.auto.policy.AutoPolicy.sent`), the all-reduce has arrived by the next step:
    waiting then costs nothing on the step's critical path (a blocking check cost ~12 ms per check on
    CPU-capped hosts). Issued ahead of the bucket, it delayed the bucket by its round trip."""
    specs, keys = list(local.costs), sorted(local.errors)
    lossy = list(next(iter(local.shadow.values()), {}))
    t = torch.tensor(_pack(local, specs, keys, lossy, window), dtype=torch.float64,
                     device=_device(group) if world > 1 else None)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True) if world > 1 else None

    def merged() -> Measurements:
        if work is not None:
            work.wait()
        return _unpack(t.tolist(), specs, keys, lossy, window)
    return merged


def _device(group) -> torch.device:
    """Where ``group``'s collectives take their tensors: NCCL reduces CUDA tensors only, gloo CPU ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


UNTIMED = 1e300  # the switch's pace of a rank that has sent nothing through it (negated, MAX keeps a timed one)
HEAD = 6         # values before the codec costs


def _pack(m: Measurements, specs: list[str], keys: list[int], lossy: list[str], window: int) -> list[float]:
    steps = (m.window[-window:] + [-1.0] * window)[:window]  # one length on every rank
    switch = -(m.switch_beta if m.switch_beta is not None else UNTIMED)  # the fastest rank's, as the link's
    return [m.alpha, -m.beta, m.pre_s, m.backward_s, m.step_s, switch, *[v for s in specs for v in m.costs[s]],
            *[m.errors[i] for i in keys], *[m.shadow[i][s] for i in keys for s in lossy], *steps]


def _unpack(v: list[float], specs: list[str], keys: list[int], lossy: list[str], window: int) -> Measurements:
    k = HEAD + 2 * len(specs)
    flat = v[k + len(keys):len(v) - window]
    return Measurements(
        alpha=v[0], beta=-v[1], pre_s=v[2], backward_s=v[3], step_s=v[4],
        switch_beta=-v[5] if -v[5] < UNTIMED else None,
        costs={s: (v[HEAD + 2 * j], v[HEAD + 1 + 2 * j]) for j, s in enumerate(specs)},
        errors=dict(zip(keys, v[k:k + len(keys)])),
        shadow={i: dict(zip(lossy, flat[j * len(lossy):(j + 1) * len(lossy)])) for j, i in enumerate(keys)},
        window=[w for w in v[len(v) - window:] if w >= 0])
