"""Each layer of a workload's layer list measured on its own: forward and backward time, the bytes of
its output (what a pipeline link carries forward, and its gradient back), the activations it saves for
backward, and its parameters: what the planner splits a model into stages by, and what the model prices
a pipeline step from (:mod:`thinwire.perf.pipeline`).

Each layer runs on the previous layer's output, detached, so its backward is its own: forward layer by
layer, then backward layer by layer from the last (with the loss's gradient at the end), timed per layer;
the median of ``reps`` after ``warmup``. Saved activations are counted with autograd's saved-tensor hooks
(distinct storages, parameters excluded), as :func:`thinwire.measure.compute.activation_bytes` does for the
whole model.

A layer's call is not all per sample: a transformer block of charlm (128 wide, context 64) took 0.84 ms
forward for 1 sample, 1.18 for 2, 1.92 for 4 and 3.36 for 8 here (0.36 ms per sample on 0.48 ms per call),
so a pipeline of many small micro-batches pays more than its samples. Each layer is timed at half the batch
too (at 2 where the batch is 1) and the line through the two points gives the fixed part per call
(``forward_fixed_s``, ``backward_fixed_s``, at least 0 and at most the whole call).
"""

from __future__ import annotations

import statistics
import time

import torch

from thinwire import batch as B
from thinwire.measure.file import LayerRecord
from thinwire.workloads.base import collate


def _saved_bytes(fn, params: set[int]) -> tuple[object, int]:
    """``fn()`` and the bytes of the distinct non-parameter storages autograd saved while it ran."""
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(n for (ptr, _), n in seen.items() if ptr not in params)


def _one_pass(layers, x, y, loss_fn) -> tuple[list[float], list[float], list, list[int]]:
    """A layer's input and output may be a tensor or a structure of them (a dict batch, a tuple between
    layers, unpacked into the next layer's arguments as a pipeline stage does)."""
    ins, outs, fwd, saved = [], [], [], []
    for layer in layers:
        inp = B.tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()), x)
        params = {p.untyped_storage().data_ptr() for p in layer.module.parameters()}
        t0 = time.perf_counter()
        out, nbytes = _saved_bytes(lambda: layer.module(*inp) if isinstance(inp, tuple) else layer.module(inp), params)
        fwd.append(time.perf_counter() - t0)
        saved.append(nbytes)
        ins.append(inp)
        outs.append(out)
        x = out
    bwd = [0.0] * len(layers)
    grads = None
    for i in range(len(layers) - 1, -1, -1):
        t0 = time.perf_counter()
        if grads is None:
            loss_fn(outs[i], y).backward()
        else:
            pairs = [(o, g) for o, g in zip(B.tensors(outs[i]), grads) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        bwd[i] = time.perf_counter() - t0
        grads = [t.grad for t in B.tensors(ins[i])]
    return fwd, bwd, outs, saved


def _timed(workload, layers, batch: int, reps: int, warmup: int):
    """Median forward and backward seconds per layer for one call of ``batch`` samples, and the last pass's
    outputs and saved bytes."""
    x, y = collate(workload.train, list(range(batch)))
    times: list[tuple[list[float], list[float]]] = []
    for i in range(warmup + reps):
        fwd, bwd, outs, saved = _one_pass(layers, x, y, workload.loss)
        if i >= warmup:
            times.append((fwd, bwd))
        for layer in layers:
            layer.module.zero_grad(set_to_none=True)
    n = len(layers)
    return ([statistics.median(f[k] for f, _ in times) for k in range(n)],
            [statistics.median(b[k] for _, b in times) for k in range(n)], outs, saved)


def fixed_part(t_lo: float, lo: int, t_hi: float, hi: int, t_at: float) -> float:
    """The per-call part of a layer's time from two batch sizes: the line's value at 0 samples, between 0 and
    the call at the profile's batch (``t_at``)."""
    slope = max(0.0, (t_hi - t_lo) / (hi - lo))
    return min(max(0.0, t_lo - slope * lo), t_at)


def measure_layers(workload, layers, batch: int, *, reps: int = 5, warmup: int = 2) -> list[LayerRecord]:
    """Per-layer costs at ``batch`` samples, reported per sample, with each call's fixed part (see the module
    docstring)."""
    fwd, bwd, outs, saved = _timed(workload, layers, batch, reps, warmup)
    other = batch // 2 if batch >= 2 else 2
    fwd2, bwd2, _, _ = _timed(workload, layers, other, reps, warmup)
    (lo, f_lo, b_lo), (hi, f_hi, b_hi) = sorted([(batch, fwd, bwd), (other, fwd2, bwd2)], key=lambda t: t[0])
    records = []
    for k, layer in enumerate(layers):
        out = outs[k]
        out_bytes = sum(t.numel() * t.element_size() for t in B.tensors(out))
        records.append(LayerRecord(
            name=layer.name, parameters=sum(p.numel() for p in layer.module.parameters()),
            forward_s=fwd[k] / batch, backward_s=bwd[k] / batch,
            output_bytes=out_bytes / batch, saved_bytes=saved[k] / batch,
            width=out.shape[-1] if torch.is_tensor(out) and out.dim() else 1,
            forward_fixed_s=fixed_part(f_lo[k], lo, f_hi[k], hi, fwd[k]),
            backward_fixed_s=fixed_part(b_lo[k], lo, b_hi[k], hi, bwd[k])))
    return records
