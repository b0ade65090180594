"""Measure each codec's encode and decode seconds, and the elementwise kernels the schemes add.

For every codec and size (a small tensor for the fixed cost, and the workload's real bucket sizes)
``compress`` and ``decompress`` of a standard-normal fp32 tensor are timed (median of ``reps``
after a warm-up) on this process's threads, and a line ``fixed_s + per_byte_s * bytes`` is fitted
by least squares. Two kernels every compressed bucket pays are measured the same way:

* ``add``: summing decoded tensors (``total += decoded``, per rank received);
* ``feedback``: error feedback's ``corrected = grad + residual`` and ``residual = corrected - sent``.

Where the workload has a layer list (a pipeline may cut it), the wire formats of a pipeline's links
(:mod:`thinwire.pipeline.wire`) are measured the same way on rows of the layers' output width, per byte
of fp32 activation: ``wire_<codec>_pack`` (the sender's forward), ``wire_<codec>_unpack`` (the receiver's
forward, and the sender's backward on the returned gradient), ``wire_<codec>_pack_grad`` (the receiver's
backward: int8 rounds gradients stochastically).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from thinwire.compress.codecs import Meta
from thinwire.compress.feedback import shadow_step
from thinwire.compress.spec import parse_codec_spec, spec_string
from thinwire.perf.fit import monotone_line
from thinwire.measure.file import CodecCost, Cost

SMALL_NUMEL = 16_384


def median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: allocator, lazy init
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fit_line(points: list[tuple[float, float]]) -> Cost:
    """``seconds = fixed + per_byte * bytes`` (:func:`thinwire.perf.fit.monotone_line`, fixed clamped at >= 0)."""
    fixed, per_byte = monotone_line(points)
    return Cost(fixed_s=max(0.0, fixed), per_byte_s=per_byte)


def sizes_for(bucket_numels: list[int]) -> list[int]:
    return sorted({SMALL_NUMEL, *(n for n in bucket_numels if n > SMALL_NUMEL)})


def measure_codec(spec: str, sizes: list[int], reps: int) -> CodecCost:
    codec = parse_codec_spec(spec)
    enc, dec = [], []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        meta = Meta(numel=n, seed=7)
        payload = codec.compress(x, meta)
        enc.append((4 * n, median_s(lambda: codec.compress(x, meta), reps)))
        dec.append((4 * n, median_s(lambda: codec.decompress(payload, meta), reps)))
    return CodecCost(encode=fit_line(enc), decode=fit_line(dec))


def measure_kernels(sizes: list[int], reps: int) -> dict[str, Cost]:
    add, feedback = [], []
    for n in sizes:
        a, b, r = torch.randn(n), torch.randn(n), torch.randn(n)
        add.append((4 * n, median_s(lambda: a.add_(b), reps)))
        feedback.append((4 * n, median_s(lambda: (r + a) - b, reps)))
    return {"add": fit_line(add), "feedback": fit_line(feedback)}


def measure_wire(width: int, numel: int, reps: int) -> dict[str, Cost]:
    """``wire_<codec>_{pack,pack_grad,unpack}`` for the pipeline link formats bf16 and int8 (module
    docstring), on ``numel`` (at least ``SMALL_NUMEL``) and 16 x as many values in rows of ``width``: sizes
    far enough apart that a busy machine's noise does not flatten the line."""
    from thinwire.pipeline.wire import pack_int8, unpack_int8

    fns = {"bf16": (lambda x: x.to(torch.bfloat16), lambda x: x.to(torch.bfloat16), lambda p: p.float()),
           "int8": (pack_int8, lambda x: pack_int8(x, stochastic=True), unpack_int8)}
    out = {}
    rows, reps = max(1, max(numel, SMALL_NUMEL) // width), max(5, reps)
    for codec, (pack, pack_grad, unpack) in fns.items():
        points: dict[str, list] = {"pack": [], "pack_grad": [], "unpack": []}
        for r in (rows, 16 * rows):
            x = torch.randn(r, width, generator=torch.Generator().manual_seed(r))
            packed = pack(x)
            points["pack"].append((4 * x.numel(), median_s(lambda: pack(x), reps)))
            points["pack_grad"].append((4 * x.numel(), median_s(lambda: pack_grad(x), reps)))
            points["unpack"].append((4 * x.numel(), median_s(lambda: unpack(packed), reps)))
        out.update({f"wire_{codec}_{k}": fit_line(v) for k, v in points.items()})
    return out


def measure_codecs(specs: list[str], bucket_numels: list[int], reps: int = 5) -> dict[str, CodecCost]:
    """Codec name (its canonical spec string) -> measured cost."""
    sizes = sizes_for(bucket_numels)
    return {spec_string(parse_codec_spec(s)): measure_codec(s, sizes, reps) for s in specs}


def ef_errors(specs: list[str], gradients: list[list]) -> dict[str, float]:
    """Codec name -> its relative compression error with error feedback on real gradients.

    ``gradients``: per training step, the list of that step's flat bucket gradients. Each lossy
    codec runs over the steps in order with an error feedback of its own (``r = (g + r_prev) -
    C(g + r_prev)``, per bucket); the result is the last step's ``||r|| / ||g + r_prev||`` over all
    buckets together: the share of what was due that a step leaves behind (the quantity ``auto``
    and the planner cap). Lossless codecs are 0. PowerSGD runs on each bucket's near-square view with
    a fresh Q, which overstates the error of its per-matrix, warm-started scheme.
    """
    out = {}
    for s in specs:
        codec = parse_codec_spec(s)
        name = spec_string(codec)
        if codec.lossless:
            out[name] = 0.0
            continue
        residuals: list = [None] * max(len(g) for g in gradients)
        left = due = 0.0
        for step in gradients:
            left = due = 0.0
            for b, g in enumerate(step):
                residuals[b], error, norm = shadow_step(codec, g, residuals[b])
                left += (error * norm) ** 2
                due += norm ** 2
        out[name] = (left / due) ** 0.5 if due > 0 else 0.0
    return out
