"""The convergence guard: how many samples a codec needs to reach DDP fp32's loss, measured on the
user's own workload (issue 27).

A codec's relative error (:func:`thinwire.measure.codec_costs.ef_errors`) says how much of each step's
gradient is left behind, not what that costs in loss: the same error is harmless on one model and
costs 13% of the final loss on another. So the guard trains: a short run of the workload, in one
process, for fp32 and for each codec, from the same initial weights on the same batches:

1. every step the global batch is split into ``world`` shards, as the ranks of a data-parallel run
   hold it; each shard's gradient is computed alone;
2. fp32 averages the shards' gradients; a codec sends each shard's gradient through its round trip
   with a residual of its own per shard (error feedback, as every rank keeps one; none for codecs
   that need none), and the received values are averaged. A low-rank codec (PowerSGD) approximates
   the average of the shards' corrected gradients, matrix by matrix with a warm-started ``Q``, as its
   distributed scheme does, and every shard keeps its own difference from that approximation;
3. the averaged gradient takes an AdamW step (the trainer's optimizer, the workload's learning rate,
   a linear warm-up over the first tenth of the run, gradients clipped to norm 1);
4. every ``every`` steps the loss on a fixed held-out set (the bounded validation subset of the
   trainer, :func:`thinwire.workloads.base.eval_subset`) is recorded.

The rule, stated: the whole comparison is made on ``orders`` data orders (seeds ``seed``, ``seed + 1``, ...:
the order of the batches and the codecs' random bits; the same initial weights), fp32 and every codec on
each. On one order, after ``steps`` steps the codec reached held-out loss ``L``; fp32's curve reached ``L``
at step ``s`` (linear interpolation between evaluations; the first step at or below ``L``). The codec's
**sample factor** is ``steps / s`` (the median over the orders): how many times the samples fp32 needed
for the same loss, assumed to hold for the whole run (a codec's loss gap to fp32 at equal samples tends to
persist, ``benchmarks/results/compare_long.md``). A codec at or below fp32's final loss has factor 1.
A codec above fp32's loss at the first evaluation has an unknown factor (``None``): worse than
anything the short run can price. **Reaches** (the guard's verdict): the codec's **gap** is at most
``REACH_TOL`` (1%), the gap being the median over the orders of (its mean held-out loss over the last half
of the evaluations / fp32's over the same evaluations - 1).

Why a median over orders of a mean over the run's second half, not the last loss of one run: a short run
ends where the loss still moves fast, and two runs that differ by a rounding error part ways (chaotic
divergence), so the last point of one run says more about the order than about the codec. fp16, exact to
2^-11 of each value, ended a 60-step run from -0.4% to +2.8% away from fp32 depending on the order on the
benchmark workloads (charlm, digits, a denoiser), as far as codecs that measurably lose 10% in a full run;
averaging the second half's evaluations and taking the median of three orders brings a near-lossless
codec's gap under the tolerance without hiding a codec whose gap is there in every order
(``benchmarks/results/guard_eval.md``).

The predicted time to fp32's loss of a candidate is then its predicted step time x its factor: what
``thinwire plan`` ranks by. The sync mode ``delayed`` (each step applies the previous step's average,
:mod:`thinwire.compress.sync.delayed`) changes the numerics too; :func:`measure_convergence` runs it the
same way (fp32 averages, one step stale) when asked, under the key ``"delayed"``. Local SGD and DiLoCo
are not run: their first average comes after their warm-up and period, beyond a short run. Cost:
``orders`` x (1 + codecs) x ``steps`` training steps of the workload at the global batch on this process
(about three minutes for charlm's default model, 5 codecs, 60 steps, 3 orders).

    >>> import torch
    >>> from thinwire.workloads.base import Workload
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <...>
    >>> x = torch.randn(512, 8); y = x @ torch.randn(8, 1)
    >>> data = list(zip(x, y))
    >>> wl = Workload(model=torch.nn.Linear(8, 1), train=data[:448], val=data[448:],
    ...               loss=torch.nn.functional.mse_loss, lr=0.05)
    >>> out = measure_convergence(wl, ["bf16", "sign"], world=2, batch=32, steps=40)
    >>> out["bf16"].factor, out["bf16"].reaches, out["sign"].reaches
    (1.0, True, False)
"""

from __future__ import annotations

import copy
import functools
import math
import statistics
import time
from typing import Callable

import torch
from torch import Tensor
from torch._utils import _unflatten_dense_tensors

from thinwire import batch as B
from thinwire.compress.codecs import Meta
from thinwire.compress.codecs.powersgd import local_approx
from thinwire.compress.spec import parse_codec_spec, spec_string
from thinwire.compress.sync.delayed import preview_step
from thinwire.config import check
from thinwire.measure.file import ConvergenceRecord
from thinwire.workloads.base import GlobalSampler, Workload, collate, eval_subset

GUARD_STEPS = 60    # training steps of each short run
LOSS_FLOOR = 1e-4   # of fp32's first held-out loss: losses closer than this are equal (see floor)
GUARD_EVERY = 5     # held-out evaluations every this many steps
GUARD_WORLD = 4     # shards (ranks) the global batch is split into
GUARD_ORDERS = 3    # data orders every comparison is made on (the verdict takes the median)
EVAL_BATCHES = 4    # held-out set: this many global batches of the validation set (fixed)
MAX_GAP = 1e6       # a gap beyond this (a diverged run) is stored as this
CLIP = 1.0          # the gradient norm the runs clip to (``thinwire train``'s default ``grad_clip``)


def measure_convergence(wl: Workload, specs: list[str], *, world: int = GUARD_WORLD, batch: int,
                        steps: int = GUARD_STEPS, every: int = GUARD_EVERY, seed: int = 0,
                        delayed: bool = False, orders: int = GUARD_ORDERS,
                        progress: Callable[[str], None] | None = None) -> dict[str, ConvergenceRecord]:
    """Codec name (canonical spec) -> its :class:`ConvergenceRecord` on ``wl`` (see the module docstring),
    and ``"delayed"`` -> the one-step-stale sync mode's with ``delayed``. ``wl.model``'s weights are
    the starting point of every run and are left as they were. ``progress`` gets a line per data order."""
    check(world >= 1, "world", world, "an integer >= 1")
    check(batch >= world, "batch", batch, f"at least one sample per shard ({world})")
    check(steps >= 2 * every >= 2, "steps", steps, f"at least two evaluations ({2 * every} steps)")
    check(orders >= 1, "orders", orders, "an integer >= 1")
    start = copy.deepcopy(wl.model.state_dict())
    evals = eval_subset(len(wl.val), EVAL_BATCHES, batch)
    codecs = {spec_string(c): c for c in map(parse_codec_spec, specs)}
    names = [*codecs, *(["delayed"] if delayed else [])]
    curves: dict[str, list] = {name: [] for name in ["fp32", *names]}  # name -> one curve per order
    try:
        for k in range(orders):
            t0 = time.perf_counter()
            order = seed + k
            run = functools.partial(_curve, wl, world=world, batch=batch, steps=steps, every=every, seed=order,
                                    start=start, evals=evals)
            reference = run(None)
            curves["fp32"].append(reference)
            for name, codec in codecs.items():
                curves[name].append(reference if codec.lossless else run(codec))
            if delayed:
                curves["delayed"].append(run(None, stale=True))
            if progress is not None:
                progress(f"guard: data order {k + 1} of {orders} ({len(names)} runs of {steps} steps against "
                         f"fp32) in {time.perf_counter() - t0:.0f} s")
    finally:
        wl.model.load_state_dict(start)
    return {name: _record(curves["fp32"], curves[name], world) for name in names}


def _record(references: list[list], runs: list[list], world: int) -> ConvergenceRecord:
    """The verdict over the data orders (module docstring): median gap, median factor, median final losses."""
    gaps = [min(MAX_GAP, tail_gap(ref, run)) for ref, run in zip(references, runs)]
    factors = [sample_factor(ref, run[-1][1]) for ref, run in zip(references, runs)]
    factor = statistics.median_high([math.inf if f is None else f for f in factors])
    return ConvergenceRecord(factor=None if math.isinf(factor) else factor,
                             loss=statistics.median(run[-1][1] for run in runs),
                             reference_loss=statistics.median(ref[-1][1] for ref in references),
                             steps=references[0][-1][0], world=world, gap=statistics.median(gaps), orders=len(runs))


def tail_gap(reference: list[tuple[int, float]], curve: list[tuple[int, float]]) -> float:
    """The mean of ``curve``'s held-out losses over the last half of its evaluations, relative to the mean of
    ``reference``'s over the same evaluations, less 1.

    >>> tail_gap([(5, 4.0), (10, 3.0), (15, 2.0), (20, 2.0)], [(5, 4.0), (10, 3.5), (15, 2.1), (20, 2.1)])
    0.050000000000000044
    """
    half = (len(curve) + 1) // 2
    ref = sum(loss for _, loss in reference[-half:])
    run = sum(loss for _, loss in curve[-half:])
    if not math.isfinite(run):
        return math.inf
    # relative to fp32's, but never to less than a loss that is (near) zero: a run that fit its data to 1e-8
    # made a difference of 1e-9 a gap of 2% (``floor``)
    return (run - ref) / max(ref, half * floor(reference))


def floor(reference: list[tuple[int, float]]) -> float:
    """The smallest loss a comparison is relative to: ``LOSS_FLOOR`` of fp32's first held-out loss. Below it two
    losses differ by nothing that matters (a model that fits its data exactly, trained to a loss of 1e-8).

    >>> floor([(5, 2.0), (10, 1e-9)])
    0.0002
    """
    return LOSS_FLOOR * abs(reference[0][1])


def sample_factor(reference: list[tuple[int, float]], loss: float) -> float | None:
    """``steps / s``: ``s`` the (interpolated) step at which fp32's curve ``reference`` [(step, loss)]
    first reaches ``loss``; 1 at or below fp32's final loss, None above its first evaluation.

    >>> sample_factor([(5, 3.0), (10, 2.0), (20, 1.0)], 2.0), sample_factor([(5, 3.0), (10, 2.0), (20, 1.0)], 1.5)
    (2.0, 1.3333333333333333)
    >>> sample_factor([(5, 3.0), (10, 2.0)], 1.9), sample_factor([(5, 3.0), (10, 2.0)], 3.5)
    (1.0, None)
    """
    steps = reference[-1][0]
    if loss <= reference[-1][1] + floor(reference):
        return 1.0
    if loss > reference[0][1]:
        return None
    for (s0, l0), (s1, l1) in zip(reference, reference[1:]):
        if l1 <= loss:
            s = s1 if l0 == l1 else s0 + (s1 - s0) * (l0 - loss) / (l0 - l1)
            return max(1.0, steps / s)
    return 1.0  # not reached: the curve is not monotone; loss <= its final value was handled above


def _curve(wl: Workload, codec, *, world: int, batch: int, steps: int, every: int, seed: int, start: dict,
           evals: list[int], stale: bool = False) -> list[tuple[int, float]]:
    """Held-out loss every ``every`` steps of one short run (fp32 with ``codec`` None; ``stale``: each
    step applies the previous step's average, the first step nothing, each shard's gradient computed at
    the weights the optimizer's step with that shard's own last gradient would give, as ``--sync delayed``)."""
    model = wl.model
    model.load_state_dict(start)
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=wl.lr, weight_decay=0.01)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    sampler = GlobalSampler(len(wl.train), batch, seed)
    feedback = ShardFeedback(codec, world, [tuple(p.shape) for p in params]) if codec is not None else None
    curve, own, previous = [], None, None  # stale: each shard's gradient and the average of the last step
    for step in range(steps):
        model.train()
        x, y = collate(wl.train, sampler.global_indices(step))
        true = [p.detach().clone() for p in params] if own is not None else None
        grads = []
        for r, (xs, ys) in enumerate(zip(B.tensor_split(x, world), B.tensor_split(y, world))):
            if own is not None:  # this shard's predicted weights, from the true ones
                preview_step(opt, params, _unflat(own[r].clone(), params), CLIP)  # it clips them in place
            grads.append(_flat_grad(wl, params, xs, ys))
            if own is not None:
                with torch.no_grad():
                    for p, t in zip(params, true):
                        p.copy_(t)
        if stale:
            own = [g.clone() for g in grads]
        avg = feedback.average(grads, step) if feedback is not None else torch.stack(grads).mean(0)
        if stale:
            avg, previous = previous, avg  # the first step applies nothing (previous is None)
        for p, g in zip(params, _unflat(avg, params) if avg is not None else [None] * len(params)):
            p.grad = g
        if avg is not None:
            torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()  # with no gradient (the pipeline fill) AdamW leaves every parameter as it is
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % every == 0:
            curve.append((step + 1, _held_out(wl, evals, batch)))
    return curve


def _unflat(flat: Tensor, params: list) -> list[Tensor]:
    """Per-parameter views of a flat gradient (``_flat_grad``'s layout), in the parameters' dtypes."""
    return [t.to(p.dtype) for t, p in zip(_unflatten_dense_tensors(flat, params), params)]


def _flat_grad(wl: Workload, params: list, x: Tensor, y: Tensor) -> Tensor:
    loss = wl.loss(wl.model(x), y)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)])


@torch.no_grad()
def _held_out(wl: Workload, evals: list[int], batch: int) -> float:
    wl.model.eval()
    total, count = 0.0, 0
    for i in range(0, len(evals), batch):
        x, y = collate(wl.val, evals[i : i + batch])
        n = B.batch_len(y)
        total += float(wl.loss(wl.model(x), y)) * n
        count += n
    loss = total / max(1, count)
    return loss if math.isfinite(loss) else math.inf


class ShardFeedback:
    """Each shard's residual for one codec, and the averaged gradient the codec delivers (module, step 2)."""

    def __init__(self, codec, world: int, shapes: list[tuple]) -> None:
        self.codec, self.shapes = codec, shapes
        self.residuals: list[Tensor | None] = [None] * world
        self.qs: dict[int, Tensor] = {}  # low-rank: warm-start Q per matrix

    def average(self, grads: list[Tensor], step: int) -> Tensor:
        feed = self.codec.needs_feedback
        corrected = [g + r if feed and r is not None else g for g, r in zip(grads, self.residuals)]
        if self.codec.lowrank:
            approx = local_approx(torch.stack(corrected).mean(0), self.shapes, self.codec.config, self.qs)
            sent = [approx] * len(corrected)
        else:
            sent = [self.codec.roundtrip(c, Meta(numel=c.numel(), seed=step, rank=i)) for i, c in enumerate(corrected)]
        if feed:
            self.residuals = [c - s for c, s in zip(corrected, sent)]
        return torch.stack(sent).mean(0)
