"""Low-rank factors (PowerSGD, Vogels et al. 2019): each matrix of the bucket travels as P and Q.

Two all-reduces per bucket: P (``rows x r`` of every matrix worth compressing, with the parameters
sent uncompressed and the 4-byte flag appended), then Q (``cols x r``) after P is orthogonalized:
``2(p-1)/p * 4 (sum (rows + cols) r + uncompressed numel + 1)`` bytes per rank. Which matrices are
compressed is :func:`~thinwire.compress.codecs.powersgd.sent_matrices` (PyTorch's rule); without the
parameter shapes the bucket is priced as the codec's near-square view of the flat buffer.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec
from thinwire.compress.codecs.common import all_finite
from thinwire.compress.codecs.powersgd import near_square, orthogonalize_, sent_matrices, start_q
from thinwire.compress.schemes.base import BucketJob, Scheme, Traffic, corrected, feedback_half, flag, remember


class LowRank(Scheme):
    """PowerSGD's two factor all-reduces with error feedback; see the module docstring."""

    name = "lowrank"

    @staticmethod
    def accepts(codec: Codec) -> bool:
        return codec.lowrank

    def traffic(self, codec: Codec, numel: int, p: int, shapes: Sequence[Sequence[int]] | None = None) -> Traffic:
        first, second = rounds(codec, numel, shapes)
        ops = (("all-reduce", 4 * first),) + ((("all-reduce", 4 * second),) if second else ())
        nb = 4 * numel
        before, after = (feedback_half(nb), ("encode", nb, 1)), (feedback_half(nb), ("decode", nb, 1))
        return Traffic(self.name, ops, before, after, numel)

    def run(self, job: BucketJob) -> tuple[Tensor, bool]:
        return _powersgd(job)


def rounds(codec: Codec, numel: int, shapes: Sequence[Sequence[int]] | None) -> tuple[int, int]:
    """fp32 elements of P's round (uncompressed parameters and the flag included) and of Q's round."""
    cfg = codec.config
    if shapes is None:  # the codec's own near-square view of the flat bucket
        rows, cols = near_square(numel)
        r = min(cfg.rank, rows, cols)
        return rows * r + 1, cols * r
    sent = sent_matrices([tuple(s) for s in shapes], cfg)
    compressed = sum(mn[0] * mn[1] for _, _, mn, _ in sent)
    first = 1 + sum(math.prod(s) for s in shapes) - compressed + sum(mn[0] * r for _, _, mn, r in sent)
    return first, sum(mn[1] * r for _, _, mn, r in sent)


def _powersgd(job: BucketJob) -> tuple[Tensor, bool]:
    cfg, wire, extra = job.codec.config, job.state.wire, job.state.extra
    x = corrected(job, job.key, job.buf)
    sent = sent_matrices(job.shapes, cfg)
    mats = [(i, x[off : off + rows * cols].view(rows, cols), r) for i, off, (rows, cols), r in sent]
    in_mats = {i for i, _, _ in mats}
    rest = [v for i, v in enumerate(_views_like(x, job.shapes)) if i not in in_mats]
    t0 = time.perf_counter()
    qs = [start_q(extra.get(f"q{job.layout[i][0]}"), m.shape[1], r, cfg.warm_start, job.layout[i][0], m.device)
          .to(m.dtype) for i, m, r in mats]  # the gradient's dtype (float64 parameters: Q starts as float32)
    ps = [m @ q for (_, m, _), q in zip(mats, qs)]
    job.state.compress_s += time.perf_counter() - t0
    first = wire.all_reduce(torch.cat([*(p.reshape(-1) for p in ps), *rest, flag(x)]))
    finite = float(first[-1]) == 0.0 and all_finite(first)
    ps, rest_sum = _split_back(first[:-1], ps, rest)
    t0 = time.perf_counter()
    for p in ps:
        orthogonalize_(p)
    qs = [m.t() @ p for (_, m, _), p in zip(mats, ps)]
    job.state.compress_s += time.perf_counter() - t0
    if qs:
        second = wire.all_reduce(torch.cat([q.reshape(-1) for q in qs]))
        qs, _ = _split_back(second, qs, [])
    out = torch.empty_like(x)
    out_views = _views_like(out, job.shapes)
    for (i, m, _), p, q in zip(mats, ps, qs):
        out_views[i].view(m.shape).copy_(p @ q.t())
        if cfg.warm_start and finite:  # a non-finite Q would start every later step: each of them non-finite
            extra[f"q{job.layout[i][0]}"] = q.clone()
    rest_idx = [i for i in range(len(job.shapes)) if i not in in_mats]
    for i, r in zip(rest_idx, rest_sum):
        out_views[i].copy_(r)
    if finite:
        remember(job, job.key, x, out / wire.world)
    return job.buf.copy_(out), finite


def _split_back(flat: Tensor, mats: list[Tensor], vecs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    out_m, out_v, offset = [], [], 0
    for m in mats:
        out_m.append(flat[offset : offset + m.numel()].view(m.shape))
        offset += m.numel()
    for v in vecs:
        out_v.append(flat[offset : offset + v.numel()])
        offset += v.numel()
    return out_m, out_v


def _views_like(flat: Tensor, shapes: list[tuple]) -> list[Tensor]:
    views, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(flat[offset : offset + size])
        offset += size
    return views
