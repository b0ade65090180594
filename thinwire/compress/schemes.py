"""How each kind of payload crosses the wire, and what each rank sends.

Per bucket of n fp32 values on p ranks, with ``s = codec.payload_bytes(n)``:

==================  ======================================================  ==========================
payload             scheme                                                  bytes sent per rank
==================  ======================================================  ==========================
lossless fp32       all-reduce in place                                     2(p-1)/p * 4n
summable            all-reduce the payload, decode the sum once             2(p-1)/p * s
(fp16, bf16,
random-k)
sparse (top-k)      all-gather (values, indices), decode and sum locally;   (p-1) * s, or 2(p-1)/p * 4n
                    a dense fp32 all-reduce instead when that is cheaper    when (p-1) s > 2(p-1)/p 4n
                    (when p * density is large)
quantized, p <= 2   all-gather payloads, decode each, sum locally           (p-1) * s
(int8, bfp, qsgd,
sign)
quantized, p > 2    compressed reduce-scatter (all-to-all of p encoded      ~ 2(p-1)/p * s
                    chunks; each rank decodes and sums its chunk), then
                    re-encode the reduced chunk (with its own error
                    feedback) and all-gather it
powersgd            all-reduce P (with the uncompressed vectors), then Q    2(p-1)/p * 4 (sum (m+n) r
                    (Vogels et al. 2019)                                    + vector numel)
==================  ======================================================  ==========================

Each payload says whether the rank's gradient was finite, so every rank learns of it in the same
collective and takes the same decision: a summable float payload in band (a NaN in its first value
makes the sum NaN everywhere), the others in an appended 4-byte flag.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import all_finite
from thinwire.compress.collectives import allgather_bytes, pack, ring_allreduce_bytes, unpack


@dataclasses.dataclass
class BucketJob:
    key: str
    buf: Tensor          # the bucket, already divided by the world size; the result is written here
    step: int
    shapes: list[tuple]  # parameter shapes in bucket order (PowerSGD needs the matrices)
    layout: tuple        # (parameter index, numel) in bucket order: residuals survive re-bucketing
    codec: Codec
    state: object        # CommState: wire, feedback, compress_s, extra


@dataclasses.dataclass
class Pending:
    """A job whose only collectives are all-reduces (sums) of ``tensors``, in this order, after which
    ``finish()`` gives (result, all ranks finite). The hook may issue them asynchronously."""

    tensors: list[Tensor]
    finish: Callable[[], tuple[Tensor, bool]]


def start(job: BucketJob) -> Pending | None:
    """The first half of a lossless or summable job (everything before its all-reduces), or None
    for the schemes whose later collectives depend on earlier results."""
    if job.codec.lossless:
        return Pending([job.buf], lambda: (job.buf, all_finite(job.buf)))
    if job.codec.summable and job.codec.name != "powersgd":
        return _summable(job)
    return None


def run(job: BucketJob) -> tuple[Tensor, bool]:
    """Average the bucket across ranks with the job's codec; returns (result, all ranks finite)."""
    codec, p = job.codec, job.state.wire.world
    pending = start(job)
    if pending is not None:
        for t in pending.tensors:
            job.state.wire.all_reduce(t)
        return pending.finish()
    if codec.name == "powersgd":
        return _powersgd(job)
    if codec.sparse or p <= 2:
        return _allgather(job)
    return _reduce_scatter_allgather(job)


def _meta(job: BucketJob, numel: int, salt: int = 0) -> Meta:
    seed = (job.step * 1_000_003 + int(job.key) * 7919 + salt) % (2**31 - 1)
    return Meta(numel=numel, dtype=torch.float32, seed=seed, rank=job.state.wire.rank)


def _corrected(job: BucketJob, key: str, x: Tensor) -> Tensor:
    fb = job.state.feedback
    layout = job.layout if key == job.key else None  # only whole-bucket residuals follow parameters
    return fb.corrected(key, x, layout) if fb is not None else x.to(torch.float32, copy=True)


def _remember(job: BucketJob, key: str, corrected: Tensor, sent: Tensor) -> None:
    """Error feedback keeps ``corrected - sent``, computed in ``corrected``'s memory (its owner is
    done with it)."""
    if job.state.feedback is not None:
        job.state.feedback.update(key, corrected, sent, job.layout if key == job.key else None)


def _flag(x: Tensor) -> Tensor:
    return torch.tensor([0.0 if all_finite(x) else 1.0], dtype=torch.float32, device=x.device)


def _encode(job: BucketJob, x: Tensor, meta: Meta) -> list[Tensor]:
    t0 = time.perf_counter()
    payload = job.codec.compress(x, meta)
    job.state.compress_s += time.perf_counter() - t0
    return payload


def _decode(job: BucketJob, payload: list[Tensor], meta: Meta) -> Tensor:
    t0 = time.perf_counter()
    out = job.codec.decompress(payload, meta).to(torch.float32)
    job.state.compress_s += time.perf_counter() - t0
    return out


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
    x = _corrected(job, job.key, job.buf) if feed or flush else job.buf
    meta = _meta(job, n)
    finite_here = all_finite(x)
    payload = _encode(job, x, meta)
    sent = _decode(job, payload, meta) if feed else None
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
            _remember(job, job.key, x, sent)
        if finite and flush:
            fb.drop(job.key)
        t0 = time.perf_counter()
        job.codec.decompress_into(summed, meta, job.buf)
        job.state.compress_s += time.perf_counter() - t0
        return job.buf, finite

    return Pending([head, *payload[1:]], finish)


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _allgather(job: BucketJob) -> tuple[Tensor, bool]:
    n, wire, p = job.buf.numel(), job.state.wire, job.state.wire.world
    x = _corrected(job, job.key, job.buf)
    meta = _meta(job, n)
    payload = _encode(job, x, meta)
    flag = _flag(x)
    if job.codec.sparse and allgather_bytes(job.codec.payload_bytes(n), p) > ring_allreduce_bytes(4 * n, p):
        sent = _decode(job, payload, meta)
        dense = wire.all_reduce(torch.cat([sent, flag]))
        finite = float(dense[-1]) == 0.0
        if finite:
            _remember(job, job.key, x, sent)
        return job.buf.copy_(dense[:-1]), finite
    like = [*payload, flag]
    total, finite, sent = torch.zeros(n, dtype=torch.float32, device=x.device), True, None
    for r, packed in enumerate(wire.all_gather(pack(like))):
        parts = unpack(packed, like)
        finite &= float(parts[-1][0]) == 0.0
        decoded = _decode(job, parts[:-1], meta)
        sent = decoded if r == wire.rank else sent
        total += decoded
    if finite:
        _remember(job, job.key, x, sent)
    return job.buf.copy_(total), finite


def _reduce_scatter_allgather(job: BucketJob) -> tuple[Tensor, bool]:
    n, wire, p = job.buf.numel(), job.state.wire, job.state.wire.world
    x = _corrected(job, job.key, job.buf)
    c = math.ceil(n / p)
    chunks = torch.nn.functional.pad(x, (0, c * p - n)).view(p, c)
    meta = _meta(job, c)
    flag = _flag(x)
    encoded = [_encode(job, chunks[i], meta) for i in range(p)]
    sent = torch.cat([_decode(job, e, meta) for e in encoded])[:n]
    like = [*encoded[0], flag]
    received = wire.all_to_all(torch.stack([pack([*e, flag]) for e in encoded]))
    mine, finite = torch.zeros(c, dtype=torch.float32, device=x.device), True
    for packed in received.unbind(0):
        parts = unpack(packed, like)
        finite &= float(parts[-1][0]) == 0.0
        mine += _decode(job, parts[:-1], meta)
    hop_key = f"{job.key}/reduced"
    corrected = _corrected(job, hop_key, mine)
    meta2 = _meta(job, c, salt=1)
    second = _encode(job, corrected, meta2)
    flag2 = torch.tensor([0.0 if finite else 1.0], device=x.device)
    out = []
    for packed in wire.all_gather(pack([*second, flag2])):
        parts = unpack(packed, [*second, flag2])
        finite &= float(parts[-1][0]) == 0.0
        out.append(_decode(job, parts[:-1], meta2))
    if finite:
        _remember(job, job.key, x, sent)
        _remember(job, hop_key, corrected, out[wire.rank])
    return job.buf.copy_(torch.cat(out)[:n]), finite


def _powersgd(job: BucketJob) -> tuple[Tensor, bool]:
    from thinwire.compress.codecs.powersgd import orthogonalize_, sent_matrices, start_q

    cfg, wire, extra = job.codec.config, job.state.wire, job.state.extra
    x = _corrected(job, job.key, job.buf)
    sent = sent_matrices(job.shapes, cfg)
    mats = [(i, x[off : off + rows * cols].view(rows, cols), r) for i, off, (rows, cols), r in sent]
    in_mats = {i for i, _, _ in mats}
    rest = [v for i, v in enumerate(_views_like(x, job.shapes)) if i not in in_mats]
    t0 = time.perf_counter()
    qs = [start_q(extra.get(f"q{job.layout[i][0]}"), m.shape[1], r, cfg.warm_start, job.layout[i][0], m.device)
          for i, m, r in mats]
    ps = [m @ q for (_, m, _), q in zip(mats, qs)]
    job.state.compress_s += time.perf_counter() - t0
    flag = _flag(x)
    first = wire.all_reduce(torch.cat([*(p.reshape(-1) for p in ps), *rest, flag]))
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
        if cfg.warm_start:
            extra[f"q{job.layout[i][0]}"] = q.clone()
    rest_idx = [i for i in range(len(job.shapes)) if i not in in_mats]
    for i, r in zip(rest_idx, rest_sum):
        out_views[i].copy_(r)
    if finite:
        _remember(job, job.key, x, out / wire.world)
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
