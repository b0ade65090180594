"""Schemes whose only collective is an all-reduce: fp32 in place, and a summable codec's payload."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import all_finite
from thinwire.compress.schemes.base import (
    BucketJob, Pending, Scheme, Traffic, corrected, decode, encode_checked, feedback_half, meta, remember,
)


class Fp32(Scheme):
    """All-reduce the fp32 bucket in place: ``2(p-1)/p * 4n`` bytes per rank, no codec work."""

    name = "fp32"

    @staticmethod
    def accepts(codec: Codec) -> bool:
        return codec.lossless

    def start(self, job: BucketJob) -> Pending:
        return Pending([job.buf], lambda: (job.buf, all_finite(job.buf)))

    def run(self, job: BucketJob) -> tuple[Tensor, bool]:
        return _issue(job, self.start(job))

    def traffic(self, codec: Codec, numel: int, p: int, shapes=None) -> Traffic:
        return Traffic(self.name, (("all-reduce", 4 * numel),))


class Summed(Scheme):
    """All-reduce the encoded payload and decode the sum once (fp16, bf16, random-k values).

    Bytes per rank: ``2(p-1)/p * s`` with ``s = payload_bytes(n)``, plus one flag element when the
    payload's first tensor is not a float (a float one carries a non-finite rank in band, as NaN).
    Codec work: encode, decode what this rank sent (for error feedback) and decode the sum; a codec
    without feedback (bf16) only encodes and decodes the sum.
    """

    name = "summable"

    @staticmethod
    def accepts(codec: Codec) -> bool:
        return codec.summable and not codec.lowrank

    def start(self, job: BucketJob) -> Pending:
        return _summable(job)

    def run(self, job: BucketJob) -> tuple[Tensor, bool]:
        return _issue(job, self.start(job))

    def traffic(self, codec: Codec, numel: int, p: int, shapes=None) -> Traffic:
        nb, s = 4 * numel, codec.payload_bytes(numel)
        ops = (("all-reduce", s + flag_bytes(codec)),)
        if not codec.needs_feedback:
            return Traffic(self.name, ops, (("encode", nb, 1),), (("decode", nb, 1),))
        before = (feedback_half(nb), ("encode", nb, 1), ("decode", nb, 1))
        return Traffic(self.name, ops, before, (feedback_half(nb), ("decode", nb, 1)), residual_values=numel)


def flag_bytes(codec: Codec) -> int:
    """Bytes of the non-finite flag appended to a summable payload: 0 when its first tensor is a float
    (the flag travels in band, as a NaN), else one element of that tensor's dtype."""
    key = (type(codec), repr(codec.config))
    if key not in _FLAG_BYTES:  # the payload's head dtype, from 64 zeros: what the codec sends, not its name
        head = codec.compress(torch.zeros(64), Meta(numel=64))[0]
        _FLAG_BYTES[key] = 0 if head.is_floating_point() else head.element_size()
    return _FLAG_BYTES[key]


_FLAG_BYTES: dict[tuple[type, str], int] = {}


def _issue(job: BucketJob, pending: Pending) -> tuple[Tensor, bool]:
    for t in pending.tensors:
        job.state.wire.all_reduce(t)
    return pending.finish()


def _summable(job: BucketJob) -> Pending:
    """Encode; the payload's all-reduce is left to the caller; ``finish`` decodes the sum once into
    the bucket.

    A rank whose gradient is not finite says so inside the payload: a NaN in its first float tensor
    makes the sum NaN on every rank (a 4-byte flag is appended only when that tensor is not a
    float). What this rank sent is decoded before the all-reduce overwrites its payload."""
    n, fb = job.buf.numel(), job.state.feedback
    feed = fb is not None and job.codec.needs_feedback
    # A codec without feedback (bf16) still sends what an earlier codec of this bucket held back, once.
    flush = fb is not None and not feed and fb.holds(job.key, job.layout)
    x = corrected(job, job.key, job.buf) if feed or flush else job.buf
    m = meta(job, n)
    payload, finite_here = encode_checked(job, x, m)
    sent = decode(job, payload, m) if feed else None
    if sent is not None and any(_shares_memory(sent, t) for t in payload):
        sent = sent.clone()  # the all-reduce writes into the payload
    head = payload[0]
    in_band = head.is_floating_point()
    if in_band:
        if not finite_here:
            head.view(-1)[0] = float("nan")
    else:
        flag = torch.tensor([0.0 if finite_here else 1.0], dtype=head.dtype, device=head.device)
        head = torch.cat([head.reshape(-1), flag])

    def finish() -> tuple[Tensor, bool]:
        finite = all_finite(head) and (in_band or float(head[-1]) == 0.0)
        summed = payload if in_band else [head[:-1].view(payload[0].shape), *payload[1:]]
        if finite and sent is not None:
            remember(job, job.key, x, sent)
        if finite and flush:
            fb.drop(job.key)
        t0 = time.perf_counter()
        job.codec.decompress_into(summed, m, job.buf)
        job.state.compress_s += time.perf_counter() - t0
        return job.buf, finite

    return Pending([head, *payload[1:]], finish)


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
