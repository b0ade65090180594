"""Payloads that must be decoded before they are summed (int8, bfp, qsgd, sign, top-k).

Per bucket of n fp32 values on p ranks, with ``s = payload_bytes(n)``:

* **sparse** (top-k): all-gather (values, indices) + a 4-byte flag, decode and sum locally:
  ``(p-1)(s+4)`` bytes per rank; a dense fp32 all-reduce of the decoded tensor instead
  (``sparse-dense``) when that is cheaper, i.e. when ``(p-1) s > 2(p-1)/p 4n`` (large ``p * density``).
* **quantized, p <= 2**: the same all-gather.
* **quantized, p > 2** (``quantized-rs``): a compressed reduce-scatter (an all-to-all of p encoded
  chunks of ``c = ceil(n/p)`` values; each rank decodes and sums its chunk), then the reduced chunk is
  re-encoded with its own error feedback and all-gathered: about ``2(p-1)/p * s`` bytes per rank.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec
from thinwire.compress.wire import allgather_bytes, pack, ring_allreduce_bytes, unpack
from thinwire.compress.schemes.base import (
    BucketJob, Scheme, Traffic, corrected, decode, encode, feedback_half, flag, meta, remember,
)


class Decoded(Scheme):
    """All-gather (or compressed reduce-scatter + all-gather) with local decoding; see the module docstring."""

    name = "decoded"

    @staticmethod
    def accepts(codec: Codec) -> bool:
        return not (codec.lossless or codec.summable or codec.lowrank)

    def run(self, job: BucketJob) -> tuple[Tensor, bool]:
        n, p = job.buf.numel(), job.state.wire.world
        form = _form(job.codec, n, p)
        if form == "sparse-dense":
            return _dense(job)
        return _allgather(job) if form != "quantized-rs" else _reduce_scatter_allgather(job)

    def traffic(self, codec: Codec, numel: int, p: int, shapes=None) -> Traffic:
        nb, s, form = 4 * numel, codec.payload_bytes(numel), _form(codec, numel, p)
        fb = feedback_half(nb)
        if form == "sparse-dense":
            before = (fb, ("encode", nb, 1), ("decode", nb, 1))
            return Traffic(form, (("all-reduce", 4 * numel + 4),), before, (fb,), numel)
        if form != "quantized-rs":
            after = (fb, ("decode", nb, p), ("add", nb, p))
            return Traffic(form, (("all-gather", s + 4),), (fb, ("encode", nb, 1)), after, numel)
        c = math.ceil(numel / p)
        cb, sc = 4 * c, codec.payload_bytes(c)
        before = (fb, ("encode", cb, p), ("decode", cb, 2 * p), ("add", cb, p), ("feedback", cb, 1), ("encode", cb, 1))
        ops = (("all-to-all", p * (sc + 4)), ("all-gather", sc + 4))
        return Traffic(form, ops, before, (fb, ("decode", cb, p)), numel + c)


def _form(codec: Codec, n: int, p: int) -> str:
    if codec.sparse:
        dense = allgather_bytes(codec.payload_bytes(n), p) > ring_allreduce_bytes(4 * n, p)
        return "sparse-dense" if dense else "sparse"
    return "quantized" if p <= 2 else "quantized-rs"


def _dense(job: BucketJob) -> tuple[Tensor, bool]:
    """Decode this rank's sparse payload and all-reduce it dense (with the flag appended)."""
    x = corrected(job, job.key, job.buf)
    m = meta(job, job.buf.numel())
    sent = decode(job, encode(job, x, m), m)
    dense = job.state.wire.all_reduce(torch.cat([sent, flag(x)]))
    finite = float(dense[-1]) == 0.0
    if finite:
        remember(job, job.key, x, sent)
    return job.buf.copy_(dense[:-1]), finite


def _allgather(job: BucketJob) -> tuple[Tensor, bool]:
    n, wire = job.buf.numel(), job.state.wire
    x = corrected(job, job.key, job.buf)
    m = meta(job, n)
    like = [*encode(job, x, m), flag(x)]
    total, finite, sent = torch.zeros(n, dtype=torch.float32, device=x.device), True, None
    for r, packed in enumerate(wire.all_gather(pack(like))):
        parts = unpack(packed, like)
        finite &= float(parts[-1][0]) == 0.0
        decoded = decode(job, parts[:-1], m)
        sent = decoded if r == wire.rank else sent
        total += decoded
    if finite:
        remember(job, job.key, x, sent)
    return job.buf.copy_(total), finite


def _reduce_scatter_allgather(job: BucketJob) -> tuple[Tensor, bool]:
    n, wire, p = job.buf.numel(), job.state.wire, job.state.wire.world
    x = corrected(job, job.key, job.buf)
    c = math.ceil(n / p)
    chunks = torch.nn.functional.pad(x, (0, c * p - n)).view(p, c)
    m, fl = meta(job, c), flag(x)
    encoded = [encode(job, chunks[i], m) for i in range(p)]
    sent = torch.cat([decode(job, e, m) for e in encoded])[:n]
    like = [*encoded[0], fl]
    received = wire.all_to_all(torch.stack([pack([*e, fl]) for e in encoded]))
    mine, finite = torch.zeros(c, dtype=torch.float32, device=x.device), True
    for packed in received.unbind(0):
        parts = unpack(packed, like)
        finite &= float(parts[-1][0]) == 0.0
        mine += decode(job, parts[:-1], m)
    hop_key = f"{job.key}/reduced"
    hop = corrected(job, hop_key, mine)
    m2 = meta(job, c, salt=1)
    second = encode(job, hop, m2)
    flag2 = torch.tensor([0.0 if finite else 1.0], device=x.device)
    out = []
    for packed in wire.all_gather(pack([*second, flag2])):
        parts = unpack(packed, [*second, flag2])
        finite &= float(parts[-1][0]) == 0.0
        out.append(decode(job, parts[:-1], m2))
    if finite:
        remember(job, job.key, x, sent)
        remember(job, hop_key, hop, out[wire.rank])
    return job.buf.copy_(torch.cat(out)[:n]), finite
