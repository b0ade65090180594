"""Predict one data-parallel step: compute, bucket communication with its codec, overlap, stragglers.

Everything is handed in as plain values or callables (DESIGN.md: perf/ imports no other thinwire
layer): bucket sizes and readiness from a profile, compute seconds at unit speed, each host's
speed, the ring's alpha/beta, and a :class:`CodecModel` built from a codec's own ``payload_bytes``
and its measured cost.

How a bucket of ``n`` fp32 values travels is priced exactly as :mod:`thinwire.compress.schemes`
moves it (same dispatch, same byte counts as ``Wire`` counts them, flags included):

=============  ==========================================================  ===========================
scheme         collectives (``s = payload_bytes(n)``)                     codec work per rank
=============  ==========================================================  ===========================
fp32           all-reduce ``4n`` (lossless codec, or ``4n <                none
               min_compress_bytes``)
summable       all-reduce ``s`` (+ a flag element unless the payload is    encode + 2 decode + EF
                                                                           (bf16: encode + decode)
               float: then a NaN carries the flag in band)
sparse         all-gather ``s + 4`` per rank, or all-reduce ``4n + 4`` when   encode + p (decode + add)
               ``(p-1) s > 2(p-1)/p 4n``                                   + EF (dense: encode +
                                                                           decode + EF)
quantized      p <= 2: all-gather ``s + 4``; p > 2: all-to-all of p         as sparse; p > 2: chunks of
               encoded chunks ``p (s_c + 4)`` then all-gather ``s_c + 4``,   ``c = ceil(n/p)`` encoded,
               ``s_c = payload_bytes(ceil(n/p))``                          decoded, re-encoded
lowrank        all-reduce P (+ uncompressed parameters + flag), then Q     encode + decode + EF
=============  ==========================================================  ===========================

Collective times are the alpha-beta formulas of :mod:`thinwire.perf.collectives` (gloo runs ring
all-reduce and ring all-gather). Codec seconds are ``fixed + per_byte * bytes`` measured on one
core, divided by the codec's speed. The step is the overlap timeline of
:mod:`thinwire.perf.timeline` on the slowest host (:mod:`thinwire.perf.straggler`).

Example (one 1 MB bucket, two hosts, 100 Mbit/s, no codec)::

    >>> codec = CodecModel(name="none", scheme=Scheme.FP32, payload_bytes=lambda n: 4 * n)
    >>> pred = predict_step(buckets=[Bucket(numel=250_000, ready_frac=1.0)],
    ...                     compute=Compute(pre_s=0.05, backward_s=0.1, post_s=0.01), speeds=[1.0, 1.0],
    ...                     network=Network(alpha_s=0.0, beta_s_per_byte=8 / 100e6), codec=codec)
    >>> round(pred.step_s, 3), pred.bytes_per_rank
    (0.24, 1000000)
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Callable, Sequence

from thinwire.perf import collectives as coll
from thinwire.perf.straggler import blom_z
from thinwire.perf.timeline import Timeline, overlap_timeline


class Scheme(str, Enum):
    FP32 = "fp32"
    SUMMABLE = "summable"
    SPARSE = "sparse"
    QUANTIZED = "quantized"
    LOWRANK = "lowrank"


def scheme_for(*, lossless: bool, summable: bool, sparse: bool, lowrank: bool) -> Scheme:
    """The scheme a codec with these properties takes (the dispatch order of ``schemes.run``)."""
    if lossless:
        return Scheme.FP32
    if lowrank:
        return Scheme.LOWRANK
    if summable:
        return Scheme.SUMMABLE
    return Scheme.SPARSE if sparse else Scheme.QUANTIZED


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearCost:
    """Seconds on one core for a tensor of ``nbytes`` fp32 bytes: ``fixed_s + per_byte_s * nbytes``."""

    fixed_s: float = 0.0
    per_byte_s: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.fixed_s + self.per_byte_s * nbytes if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecModel:
    """What the model needs to know about a codec (built above perf/ from a real codec).

    ``payload_bytes(numel)``: the codec's own ``payload_bytes``; ``flag_bytes``: bytes of the
    non-finite flag appended to a summable payload (0 when its first tensor is float: the flag
    travels in band, as a NaN; else one element of its dtype); ``feedback_used``: whether the hook
    keeps a residual for it (the codec's ``needs_feedback``; bf16 does not);
    ``lowrank_rounds(bucket)``: for PowerSGD, the fp32 elements of its two all-reduces for that
    bucket (P with the uncompressed parameters and the flag; Q).
    """

    name: str
    scheme: Scheme
    payload_bytes: Callable[[int], int]
    flag_bytes: int = 0
    feedback_used: bool = True
    encode: LinearCost = LinearCost()
    decode: LinearCost = LinearCost()
    add: LinearCost = LinearCost()
    feedback: LinearCost = LinearCost()
    lowrank_rounds: Callable[[int], tuple[int, int]] | None = None
    min_compress_bytes: int = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bucket:
    """A DDP bucket: ``numel`` fp32 values, ready at ``ready_frac`` of backward (0..1)."""

    numel: int
    ready_frac: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Compute:
    """Seconds at speed 1 for one rank's batch: data + forward, backward, clip + optimizer; and the
    standard deviation of a step's compute (noise that makes the slowest of p hosts slower)."""

    pre_s: float
    backward_s: float
    post_s: float
    std_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.pre_s + self.backward_s + self.post_s


@dataclasses.dataclass(frozen=True, kw_only=True)
class Network:
    """The ring's latency per message (s) and pace (s/byte, the slowest edge's)."""

    alpha_s: float
    beta_s_per_byte: float


@dataclasses.dataclass(frozen=True)
class BucketCost:
    numel: int
    scheme: str
    collectives: tuple[tuple[str, int], ...]  # (all-reduce | all-gather | all-to-all, size argument in bytes)
    bytes_sent: int                           # per rank, as thinwire's Wire counts it
    comm_s: float
    encode_s: float                           # codec work before the last collective
    decode_s: float                           # codec work after it


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    p: int
    timeline: Timeline
    buckets: tuple[BucketCost, ...]
    compute_s: float        # the slowest host's compute alone (no communication, no codec)
    noise_s: float          # expected extra time of the slowest of p noisy hosts

    @property
    def step_s(self) -> float:
        return self.timeline.step_s

    @property
    def exposed_comm_s(self) -> float:
        return self.timeline.exposed_comm_s

    @property
    def codec_s(self) -> float:
        return sum(b.encode_s + b.decode_s for b in self.buckets)

    @property
    def comm_s(self) -> float:
        return sum(b.comm_s for b in self.buckets)

    @property
    def bytes_per_rank(self) -> int:
        return sum(b.bytes_sent for b in self.buckets)


def _ring_bytes(n: int, p: int) -> int:
    return 0 if p <= 1 else (2 * (p - 1) * n) // p


def _allgather_bytes(s: int, p: int) -> int:
    return (p - 1) * s


def _alltoall_bytes(n: int, p: int) -> int:
    return 0 if p <= 1 else ((p - 1) * n) // p


_BYTES = {"all-reduce": _ring_bytes, "all-gather": _allgather_bytes, "all-to-all": _alltoall_bytes}
_TIME = {"all-reduce": coll.ring_allreduce_s, "all-gather": coll.allgather_s, "all-to-all": coll.alltoall_s}


def bucket_collectives(codec: CodecModel, index: int, numel: int, p: int) -> tuple[str, list[tuple[str, int]]]:
    """(scheme name, collectives) for bucket ``index`` of ``numel`` values on ``p`` ranks."""
    if codec.scheme is Scheme.FP32 or numel * 4 < codec.min_compress_bytes:
        return "fp32", [("all-reduce", 4 * numel)]
    s = codec.payload_bytes(numel)
    if codec.scheme is Scheme.SUMMABLE:
        return "summable", [("all-reduce", s + codec.flag_bytes)]
    if codec.scheme is Scheme.LOWRANK:
        assert codec.lowrank_rounds is not None, "a lowrank codec needs lowrank_rounds"
        first, second = codec.lowrank_rounds(index)
        return "lowrank", [("all-reduce", 4 * first)] + ([("all-reduce", 4 * second)] if second else [])
    if codec.scheme is Scheme.SPARSE and _allgather_bytes(s, p) > _ring_bytes(4 * numel, p):
        return "sparse-dense", [("all-reduce", 4 * numel + 4)]
    if codec.scheme is Scheme.SPARSE or p <= 2:
        return codec.scheme.value, [("all-gather", s + 4)]
    sc = codec.payload_bytes(math.ceil(numel / p))
    return "quantized-rs", [("all-to-all", p * (sc + 4)), ("all-gather", sc + 4)]


def codec_seconds(codec: CodecModel, scheme: str, numel: int, p: int) -> tuple[float, float]:
    """(before the last collective, after it): one core's codec seconds for this bucket."""
    nb, fb = 4 * numel, codec.feedback(4 * numel) / 2
    enc, dec, add = codec.encode, codec.decode, codec.add
    if scheme == "fp32":
        return 0.0, 0.0
    if scheme == "summable" and not codec.feedback_used:  # bf16: encode, decode the sum
        return enc(nb), dec(nb)
    if scheme in ("summable", "sparse-dense"):
        return fb + enc(nb) + dec(nb), fb + (dec(nb) if scheme == "summable" else 0.0)
    if scheme == "lowrank":
        return fb + enc(nb), fb + dec(nb)
    if scheme == "quantized-rs":
        cb = 4 * math.ceil(numel / p)
        before = fb + p * (enc(cb) + dec(cb)) + p * (dec(cb) + add(cb)) + codec.feedback(cb) + enc(cb)
        return before, fb + p * dec(cb)
    return fb + enc(nb), fb + p * (dec(nb) + add(nb))


def bucket_cost(codec: CodecModel, index: int, numel: int, p: int, network: Network,
                codec_speed: float = 1.0) -> BucketCost:
    """Bytes, wire seconds and codec seconds of one bucket (see the module docstring)."""
    scheme, ops = bucket_collectives(codec, index, numel, p)
    sent = sum(_BYTES[kind](size, p) for kind, size in ops)
    comm = sum(_TIME[kind](size, p, alpha=network.alpha_s, beta=network.beta_s_per_byte) for kind, size in ops)
    before, after = codec_seconds(codec, scheme, numel, p) if p > 1 else (0.0, 0.0)
    return BucketCost(numel, scheme, tuple(ops), sent, comm, before / codec_speed, after / codec_speed)


def predict_step(*, buckets: Sequence[Bucket], compute: Compute, speeds: Sequence[float], network: Network,
                 codec: CodecModel | Sequence[CodecModel], codec_speed: float | None = None,
                 codec_steals_compute: bool = False) -> StepPrediction:
    """Predicted step of ``p = len(speeds)`` hosts (speeds relative to the profile's measurement).

    ``codec``: one model for every bucket, or one per bucket (a per-bucket plan such as ``auto``'s).

    The slowest host sets the compute (its backward decides when each bucket is ready); its
    expected noise ``std_s * z_p`` delays the step; codec work runs at ``codec_speed`` (default: the
    slowest host's speed, at most 1: the communication thread is single-threaded).
    """
    p = len(speeds)
    if p < 1 or min(speeds) <= 0:
        raise ValueError(f"speeds must list one positive speed per host, got {list(speeds)}")
    slow = min(speeds)
    cspeed = codec_speed if codec_speed is not None else min(1.0, slow)
    noise = compute.std_s / slow * blom_z(p)
    models = [codec] * len(buckets) if isinstance(codec, CodecModel) else list(codec)
    if len(models) != len(buckets):
        raise ValueError(f"need one codec model per bucket, got {len(models)} for {len(buckets)} buckets")
    costs = tuple(bucket_cost(c, i, b.numel, p, network, cspeed) for i, (c, b) in enumerate(zip(models, buckets)))
    backward = compute.backward_s / slow
    timeline = overlap_timeline(
        ready_s=[min(1.0, max(0.0, b.ready_frac)) * backward for b in buckets],
        comm_s=[c.comm_s for c in costs], encode_s=[c.encode_s for c in costs],
        decode_s=[c.decode_s for c in costs], backward_s=backward,
        pre_s=compute.pre_s / slow + noise, post_s=compute.post_s / slow,
        codec_steals_compute=codec_steals_compute)
    return StepPrediction(p=p, timeline=timeline, buckets=costs, compute_s=compute.total_s / slow, noise_s=noise)
