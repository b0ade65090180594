"""Predict one data-parallel step: compute, bucket communication with its codec, overlap, stragglers.

Everything is handed in as plain values or callables (DESIGN.md: perf/ imports no other thinwire
layer): bucket sizes and readiness from a profile, compute seconds at unit speed, each host's
speed, the ring's alpha/beta, and a :class:`CodecModel` built from a codec's own ``payload_bytes``
and its measured cost.

How a bucket travels is not decided here: each :class:`CodecModel` carries a ``traffic`` callable
(built above perf/ from the scheme that runs the bucket, :mod:`thinwire.compress.schemes`) that
states the bucket's collectives, in order, the bytes they put on the wire (as ``Wire`` counts them),
and the codec work before and after the last of them, as (kernel, fp32 bytes, times). This module
prices them: wire seconds from the collectives, codec seconds from the measured kernel costs.

Collective times are the alpha-beta formulas of :mod:`thinwire.perf.collectives` (gloo runs ring
all-reduce and ring all-gather), or the host CPU they use (``Network.cpu_s_per_byte`` per byte sent,
at the host's speed) where that is slower. Codec seconds are ``fixed + per_byte * bytes`` measured on one
core, divided by the codec's speed. The step is the overlap timeline of
:mod:`thinwire.perf.timeline` on the slowest host (:mod:`thinwire.perf.straggler`).

Example (one 1 MB bucket, two hosts, 100 Mbit/s, no codec)::

    >>> fp32 = lambda index, numel, p: Traffic(scheme="fp32", collectives=(("all-reduce", 4 * numel),),
    ...                                        bytes_sent=2 * (p - 1) * 4 * numel // p)
    >>> codec = CodecModel(name="none", traffic=fp32)
    >>> pred = predict_step(buckets=[Bucket(numel=250_000, ready_frac=1.0)],
    ...                     compute=Compute(pre_s=0.05, backward_s=0.1, post_s=0.01), speeds=[1.0, 1.0],
    ...                     network=Network(alpha_s=0.0, beta_s_per_byte=8 / 100e6), codec=codec)
    >>> round(pred.step_s, 3), pred.bytes_per_rank
    (0.24, 1000000)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from thinwire.perf import collectives as coll
from thinwire.perf.straggler import blom_z
from thinwire.perf.timeline import Timeline, overlap_timeline


@dataclasses.dataclass(frozen=True, kw_only=True)
class Traffic:
    """How one bucket travels (what a scheme states; any object with these fields will do).

    ``collectives``: (all-reduce | all-gather | all-to-all, size argument in bytes), in order;
    ``before`` / ``after``: codec work before and after the last collective, as (kernel: encode |
    decode | add | feedback, fp32 bytes, times); ``residual_values``: fp32 entries error feedback keeps;
    ``bytes_sent``: what one rank puts on the wire for the bucket.
    """

    scheme: str
    collectives: tuple[tuple[str, int], ...]
    before: tuple[tuple[str, int, float], ...] = ()
    after: tuple[tuple[str, int, float], ...] = ()
    residual_values: int = 0
    bytes_sent: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearCost:
    """Seconds on one core for a tensor of ``nbytes`` fp32 bytes: ``fixed_s + per_byte_s * nbytes``."""

    fixed_s: float = 0.0
    per_byte_s: float = 0.0

    def __call__(self, nbytes: float) -> float:
        return self.fixed_s + self.per_byte_s * nbytes if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodecModel:
    """What the model needs to know about a codec (built above perf/ from a real codec and its scheme).

    ``traffic(index, numel, p)``: how bucket ``index`` of ``numel`` fp32 values travels on ``p``
    ranks (a :class:`Traffic`); the kernel costs are one core's measured seconds.
    """

    name: str
    traffic: Callable[[int, int, int], Traffic]
    encode: LinearCost = LinearCost()
    decode: LinearCost = LinearCost()
    add: LinearCost = LinearCost()
    feedback: LinearCost = LinearCost()

    def work_s(self, work: Sequence[tuple[str, int, float]]) -> float:
        """One core's seconds for ``work``, a sequence of (kernel, fp32 bytes, times)."""
        return sum(times * getattr(self, kernel)(nbytes) for kernel, nbytes, times in work)


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
    """The ring's latency per message (s) and pace (s/byte, the slowest edge's); ``cpu_s_per_byte``:
    the host CPU a collective uses per byte a rank sends, at speed 1 (copies through the TCP stack,
    the reduction; :mod:`thinwire.measure.collective`)."""

    alpha_s: float
    beta_s_per_byte: float
    cpu_s_per_byte: float = 0.0
    busy_hop_s: float = 0.0  # a ring hop's wait for a CPU quota while the host computes (timeline docstring)
    switch_speed: float | None = None  # the switch's aggregator's speed (its cores, one thread); None: it keeps up
    # the aggregator's CPU per bucket and trainer, measured uncapped (``bucket + value * numel``; profile's
    # ``aggregator``); None: priced from the transport's per-byte CPU and the codec's kernels
    switch_cpu: tuple[float, float] | None = None
    # exchanges through the switch as timed on the trainers (``auto``'s meter), the aggregator's work
    # included, as the beta of collectives.switch_s (``switch_pace``); None: priced from its parts
    switch_beta_s_per_byte: float | None = None
    # a trainer's own CPU per exchange through the switch at speed 1 (``bucket + value * numel``: the agreed
    # scales, quantizing, a send and a receive per chunk, decoding; profile's ``aggregator``); None: the
    # bytes it sends at ``cpu_s_per_byte``, as for a collective, and the codec's kernels
    switch_trainer_cpu: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class BucketCost:
    numel: int
    scheme: str
    collectives: tuple[tuple[str, int], ...]  # (all-reduce | all-gather | all-to-all, size argument in bytes)
    bytes_sent: int                           # per rank, as thinwire's Wire counts it
    comm_s: float                             # the collectives: the wire or the host CPU, whichever is slower
    encode_s: float                           # codec work before the last collective
    decode_s: float                           # codec work after it
    residual_values: int = 0                  # fp32 entries error feedback keeps for this bucket
    comm_cpu_s: float = 0.0                   # host CPU the collectives use (within comm_s)
    hops: int = 0                             # messages on the collectives' critical path (ring hops)


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


_TIME = {"all-reduce": coll.ring_allreduce_s, "all-gather": coll.allgather_s, "all-to-all": coll.alltoall_s,
         "switch": coll.switch_s}


def bucket_cost(codec: CodecModel, index: int, numel: int, p: int, network: Network,
                codec_speed: float = 1.0) -> BucketCost:
    """Bytes, wire seconds and codec seconds of one bucket (see the module docstring)."""
    t = codec.traffic(index, numel, p)
    ops = tuple(t.collectives)
    wire = sum(_TIME[kind](size, p, alpha=network.alpha_s, beta=_beta(kind, network)) for kind, size in ops)
    cpu = t.bytes_sent * network.cpu_s_per_byte / codec_speed if p > 1 else 0.0
    before, after = (codec.work_s(t.before), codec.work_s(t.after)) if p > 1 else (0.0, 0.0)
    if p > 1 and network.switch_trainer_cpu is not None and any(kind == "switch" for kind, _ in ops):
        per_bucket, per_value = network.switch_trainer_cpu  # measured whole: less the kernels priced apart
        cpu = max(cpu, (per_bucket + per_value * numel - before - after) / codec_speed)
    if p > 1 and network.switch_beta_s_per_byte is None:  # through a capped aggregator: its work joins the chunks' pipeline
        wire += sum(aggregator_lag_s(aggregator_s(codec, numel, size, p, network), size, network)
                    for kind, size in ops if kind == "switch")
    return BucketCost(numel, t.scheme, ops, t.bytes_sent, max(wire, cpu), before / codec_speed, after / codec_speed,
                      t.residual_values, cpu, sum(ring_hops(kind, p) for kind, _ in ops) if p > 1 else 0)


def _beta(kind: str, network: Network) -> float:
    """Seconds per byte of a collective of ``kind``: the link's, or through the switch as measured whole."""
    if kind == "switch" and network.switch_beta_s_per_byte is not None:
        return network.switch_beta_s_per_byte
    return network.beta_s_per_byte


def aggregator_s(codec: CodecModel, numel: int, size: int, p: int, network: Network) -> float:
    """The switch's aggregator's seconds for one bucket of ``numel`` values that each of ``p`` hosts sends
    as ``size`` bytes (:func:`thinwire.compress.switch.serve`): as measured (``network.switch_cpu``, per
    trainer, :mod:`thinwire.measure.aggregator`), else from its parts: the transport's CPU for ``p`` hosts' bytes
    in and the sum's out, ``p`` int8 payloads added, the sum re-encoded with error feedback (decode, the
    residual added, encode, decode for the new residual), all on the aggregator's one thread at
    ``network.switch_speed``. Chunk by chunk it is one stage of the wire's pipeline (:func:`aggregator_lag_s`).
    0 where the aggregator is taken to keep up (``switch_speed`` None)."""
    if network.switch_speed is None:
        return 0.0
    if network.switch_cpu is not None:
        bucket, value = network.switch_cpu
        return p * (bucket + value * numel) / network.switch_speed
    nb = 4 * numel
    work = codec.work_s((("add", nb, p), ("decode", nb, 2), ("feedback", nb, 1), ("encode", nb, 1)))
    return (p * size * network.cpu_s_per_byte + work) / network.switch_speed


def aggregator_lag_s(agg_s: float, size: int, network: Network) -> float:
    """What a bucket's ``agg_s`` of aggregator work adds to its time on the wire
    (:func:`thinwire.perf.collectives.switch_s`). The bucket's ``k`` chunks flow through three stages, up the
    host's link (``u`` per chunk), the aggregator (``a = agg_s / k``) and down (``u``): a pipeline of
    ``u + a + u + (k-1) max(u, a)`` seconds, against the wire's ``u + u + (k-1) u`` alone. So ``a`` when the
    link is the slower stage (one chunk's sum on the critical path), ``agg_s + 2u`` in all when the
    aggregator is."""
    if agg_s <= 0.0:
        return 0.0
    chunk = min(size, coll.SWITCH_CHUNK_BYTES)
    k, u = max(1, math.ceil(size / coll.SWITCH_CHUNK_BYTES)), chunk * network.beta_s_per_byte
    a = agg_s / k
    return a + (k - 1) * max(0.0, a - u)


def ring_hops(kind: str, p: int) -> int:
    """Messages one after another on a collective's critical path: 2(p-1) for an all-reduce
    (reduce-scatter, then all-gather), p-1 for an all-gather or all-to-all, 4 through the switch."""
    if kind == "switch":
        return coll.SWITCH_MESSAGES
    return 2 * (p - 1) if kind == "all-reduce" else p - 1


def predict_step(*, buckets: Sequence[Bucket], compute: Compute, speeds: Sequence[float], network: Network,
                 codec: CodecModel | Sequence[CodecModel], codec_speed: float | None = None,
                 codec_steals_compute: bool = False) -> StepPrediction:
    """Predicted step of ``p = len(speeds)`` hosts (speeds relative to the profile's measurement).

    ``codec``: one model for every bucket, or one per bucket (a per-bucket plan such as ``auto``'s).

    The slowest host sets the compute (its backward decides when each bucket is ready); its
    expected noise ``std_s * z_p`` delays the step; codec work and the collectives' host CPU run at
    ``codec_speed`` (default: the slowest host's speed, at most 1: the communication thread is
    single-threaded). A collective lasts the longer of its wire time and its host CPU time (the
    two are pipelined: the kernel copies one segment while the link carries the previous one).
    With ``codec_steals_compute`` (no core to spare) codec work and the collectives' CPU that run
    during backward delay it.
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
        decode_s=[c.decode_s for c in costs], comm_cpu_s=[c.comm_cpu_s for c in costs], backward_s=backward,
        busy_wait_s=[c.hops * network.busy_hop_s for c in costs],
        pre_s=compute.pre_s / slow + noise, post_s=compute.post_s / slow,
        codec_steals_compute=codec_steals_compute)
    return StepPrediction(p=p, timeline=timeline, buckets=costs, compute_s=compute.total_s / slow, noise_s=noise)
