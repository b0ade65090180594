"""The profile file: what ``thinwire profile`` measured, read back by ``thinwire simulate``.

A YAML mapping, plain values in SI units (seconds, bytes, bit/s, FLOPs)::

    version: 1
    workload: charlm
    model: {width: 128}          # the workload's options as given
    threads: 1                   # torch threads the measurement used (speed 1 in the model)
    bucket_mb: 25.0              # DDP bucket cap of the measured layout
    parameters: 443008
    machine: {cpu: ..., cores: 2, torch: 2.13.0}
    compute:                     # one entry per per-rank batch size measured
      - {batch: 8, pre_s: 0.004, forward_s: 0.02, backward_s: 0.04, post_s: 0.003, std_s: 0.001}
    flops_per_sample: 1.2e8      # forward + backward, torch.utils.flop_counter
    achieved_flops: 3.0e9        # FLOP/s measured on this machine at `threads`
    activation_bytes_per_sample: 1.5e6
    buckets:                     # DDP's layout after its rebuild, in the order buckets are reduced
      - {numel: 443008, ready_frac: 1.0, params: [12, 11, ...], shapes: [[256, 128], ...]}
    corun_speed: {"2": 0.83, "3": 0.8, "4": 0.78}  # n copies at once: each one's speed over its fair
                                 # share min(1, cores/n) of one copy alone (n > cores: time-sharing)
    collective_cpu_s_per_byte: 1.1e-9  # host CPU of a gloo all-reduce per byte a rank sends (2 local ranks)
    kernels: {add: {fixed_s: 0, per_byte_s: 1e-10}, feedback: {...}, wire_int8_pack: {...}, ...}  # wire_*:
                                 # a pipeline link's formats, per fp32 byte (with a layer list only)
    codecs: {bf16: {encode: {fixed_s: ..., per_byte_s: ...}, decode: {...}, ef_error: 0.002,
             convergence: {factor: 1.0, loss: 2.31, reference_loss: 2.31, steps: 60, world: 4,
                                          gap: 0.002, orders: 3}}, ...}
    sync: {delayed: {factor: 1.4, loss: 2.5, reference_loss: 2.31, steps: 60, world: 4}}  # the guard's
    network: {alpha_s: 1e-4, efficiency: 0.93, ...}   # only with --cluster
    host_speed: {cluster: lab, threads: 1, batch: 8, speed: {h0: 0.41, h1: 0.23}}  # only with --cluster: each
                                 # host's step speed there, all at once, over this profile's (measure.hostspeed)
    aggregator: {trainers: 4, per_bucket_s: 3.6e-3, per_value_s: 8.3e-9,   # only with --cluster of a spec with
                 trainer_per_bucket_s: 1.0e-3, trainer_per_value_s: 1.4e-8}  # `switch:`: the aggregator's CPU
                                 # per bucket, uncapped, and each trainer's own (measure.aggregator)

All costs are one core's (``threads``) on the machine in ``machine``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from thinwire.config import check, check_range, load_dataclass, save_yaml
from thinwire.errors import ThinwireError

VERSION = 1
# TCP payload per Ethernet frame on a 1500-byte MTU with TCP timestamps: 1448 of 1514 bytes (tbf counts
# the Ethernet header). The default share of a link's rate that carries data when no probe was run.
TCP_EFFICIENCY = 1448 / 1514
MAX_SECONDS = 1e6  # a measured cost beyond this (11 days) is a corrupt profile
REACH_TOL = 0.01  # the convergence guard's "reaches fp32's loss": within 1% of it at equal samples
DEFAULT_ALPHA_S = 1e-4  # per-message latency when no probe was run (a LAN round of gloo); measure it


@dataclasses.dataclass(kw_only=True)
class Cost:
    """Seconds on one core for ``nbytes`` of fp32 input: ``fixed_s + per_byte_s * nbytes``."""

    fixed_s: float = 0.0
    per_byte_s: float = 0.0

    def __post_init__(self) -> None:
        check_range("fixed_s", self.fixed_s, 0, MAX_SECONDS)
        check_range("per_byte_s", self.per_byte_s, 0, MAX_SECONDS)


def gap_text(gap: float, digits: int = 1) -> str:
    """A relative gap to fp32's loss as people read it: ``+3.2%``, or ``57.7x fp32's loss`` from 10x up."""
    if gap < 9:
        return f"{gap:+.{digits}%}"
    return f"{1 + gap:,.0f}x fp32's loss" if gap >= 99 else f"{1 + gap:.1f}x fp32's loss"


@dataclasses.dataclass(kw_only=True)
class ConvergenceRecord:
    """The convergence guard's short run of this codec against fp32 (:mod:`thinwire.measure.convergence`)."""

    factor: float | None          # samples relative to fp32 for the loss it reached; None: unknown (worse)
    loss: float                   # held-out loss after ``steps`` (median over the data orders)
    reference_loss: float         # fp32's
    steps: int
    world: int
    # the verdict's gap to fp32 at equal samples: median over ``orders`` data orders of the mean held-out
    # loss over the last half of the run against fp32's; None (a profile from before it): loss / reference - 1
    gap: float | None = None
    orders: int = 1

    @property
    def reaches(self) -> bool:
        """The guard's verdict: within ``REACH_TOL`` of fp32's loss at equal samples."""
        return self.relative_gap <= REACH_TOL

    @property
    def relative_gap(self) -> float:
        return self.gap if self.gap is not None else self.loss / self.reference_loss - 1

    def gap_text(self, digits: int = 1) -> str:
        """The gap for people: a percentage, or a multiple of fp32's loss where fp32's is near 0 (a toy task's
        +576680% says less than 5,768x)."""
        return gap_text(self.relative_gap, digits)

    def __post_init__(self) -> None:
        check_range("factor", self.factor, 1, 1e6)
        check_range("gap", self.gap, -1, 1e6)
        check_range("orders", self.orders, 1, 1000, kind="an integer")
        check_range("steps", self.steps, 1, 10**9, kind="an integer")
        check_range("world", self.world, 1, 10**6, kind="an integer")


@dataclasses.dataclass(kw_only=True)
class CodecCost:
    encode: Cost
    decode: Cost
    # relative compression error with error feedback on the workload's own gradients: ||r|| / ||g + r_prev||
    # after a few steps in shadow (thinwire.measure.codec_costs.ef_errors); None if not measured
    ef_error: float | None = None
    convergence: ConvergenceRecord | None = None  # the convergence guard; None if not measured

    def __post_init__(self) -> None:
        check_range("ef_error", self.ef_error, 0, 1e6)


@dataclasses.dataclass(kw_only=True)
class ComputePoint:
    """Seconds of one training step at a per-rank ``batch``: data + forward, backward, clip + optimizer."""

    batch: int
    pre_s: float
    backward_s: float
    post_s: float
    std_s: float = 0.0
    forward_s: float = 0.0

    def __post_init__(self) -> None:
        check_range("batch", self.batch, 1, 10**9, kind="an integer")
        for name in ("pre_s", "backward_s", "post_s", "std_s", "forward_s"):
            check_range(name, getattr(self, name), 0, MAX_SECONDS, kind="seconds")


@dataclasses.dataclass(kw_only=True)
class BucketRecord:
    numel: int
    ready_frac: float
    params: list[int]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        check_range("numel", self.numel, 0, 2**62, kind="an integer")
        check_range("ready_frac", self.ready_frac, 0, 1)


@dataclasses.dataclass(kw_only=True)
class LayerRecord:
    """One layer of the workload's layer list (:mod:`thinwire.measure.layers`), per sample at the profile's batch
    (``layers_batch``), and the part of a call that does not grow with the batch (``*_fixed_s``, per call)."""

    name: str
    parameters: int
    forward_s: float
    backward_s: float
    output_bytes: float            # its output: what a pipeline link carries forward (and the gradient back)
    saved_bytes: float             # activations it saves for backward
    width: int = 1                 # the output's last dimension (rows of an int8 link)
    forward_fixed_s: float = 0.0   # per call, whatever the batch (0: not measured, every cost per sample)
    backward_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        check_range("parameters", self.parameters, 0, 2**62, kind="an integer")
        for name in ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s"):
            check_range(name, getattr(self, name), 0, MAX_SECONDS, kind="seconds")
        for name in ("output_bytes", "saved_bytes"):
            check_range(name, getattr(self, name), 0, 1e18)
        check_range("width", self.width, 1, 2**31, kind="an integer")

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    def forward_call_s(self, micro: int, batch: int) -> float:
        """One forward of ``micro`` samples, measured at ``batch`` (the profile's ``layers_batch``): the fixed
        part plus the rest in proportion."""
        return _call_s(self.forward_s, self.forward_fixed_s, micro, batch)

    def backward_call_s(self, micro: int, batch: int) -> float:
        return _call_s(self.backward_s, self.backward_fixed_s, micro, batch)


def _call_s(per_sample: float, fixed: float, micro: int, batch: int) -> float:
    at = per_sample * max(1, batch)
    fixed = min(fixed, at)
    return fixed + (at - fixed) * micro / max(1, batch)


@dataclasses.dataclass(kw_only=True)
class NetworkRecord:
    """From small and large all-reduce probes across ``hosts`` hosts of ``cluster``."""

    alpha_s: float
    efficiency: float
    nominal_bps: float
    measured_bps: float
    hosts: int
    cluster: str
    sizes: list[int] = dataclasses.field(default_factory=list)
    times_s: list[float] = dataclasses.field(default_factory=list)
    # a ring hop's wait for the hosts' CPU quotas while they compute (thinwire.cluster.bench.busy_latency)
    busy_hop_s: float | None = None
    # one-way time of a small point-to-point message between two hosts (thinwire.measure.network)
    p2p_latency_s: float | None = None
    # a token bucket's credit on a host's link: bytes that leave at once after an idle gap (thinwire.measure.network)
    burst_bytes: float | None = None

    def __post_init__(self) -> None:
        check_range("alpha_s", self.alpha_s, 0, MAX_SECONDS)
        check_range("p2p_latency_s", self.p2p_latency_s, 0, MAX_SECONDS)
        check_range("busy_hop_s", self.busy_hop_s, 0, MAX_SECONDS)
        check_range("burst_bytes", self.burst_bytes, 0, 1e12)
        check_range("efficiency", self.efficiency, 0, 1, open_lo=True)
        check_range("nominal_bps", self.nominal_bps, 0, 1e13, open_lo=True)
        check_range("measured_bps", self.measured_bps, 0, 1e13, open_lo=True)
        check_range("hosts", self.hosts, 1, 10**6, kind="an integer")


@dataclasses.dataclass(kw_only=True)
class AggregatorRecord:
    """The switch's aggregator's CPU per bucket of n values from ``trainers`` trainers, at this machine's
    speed 1: ``per_bucket_s + per_value_s * n``; and one trainer's own CPU per such exchange, likewise
    (``trainer_*``; None in profiles made before it was measured). :mod:`thinwire.measure.aggregator`."""

    trainers: int
    per_bucket_s: float
    per_value_s: float
    trainer_per_bucket_s: float | None = None
    trainer_per_value_s: float | None = None

    def __post_init__(self) -> None:
        check_range("aggregator.trainers", self.trainers, 1, 2**20, kind="an integer")
        check_range("aggregator.per_bucket_s", self.per_bucket_s, 0, MAX_SECONDS)
        check_range("aggregator.per_value_s", self.per_value_s, 0, 1e-3)
        if self.trainer_per_bucket_s is not None or self.trainer_per_value_s is not None:
            check_range("aggregator.trainer_per_bucket_s", self.trainer_per_bucket_s, 0, MAX_SECONDS)
            check_range("aggregator.trainer_per_value_s", self.trainer_per_value_s, 0, 1e-3)

    @property
    def trainer_cpu(self) -> tuple[float, float] | None:
        """One trainer's CPU per exchange, ``(per bucket, per value)``, where measured."""
        if self.trainer_per_bucket_s is None or self.trainer_per_value_s is None:
            return None
        return self.trainer_per_bucket_s, self.trainer_per_value_s


@dataclasses.dataclass(kw_only=True)
class HostSpeedRecord:
    """Each host's speed on emulated cluster ``cluster``: the workload's training step at ``batch`` with
    ``threads`` threads run on every host at once, relative to one process alone on this machine (the
    profile's own speed, 1.0). :mod:`thinwire.measure.hostspeed`."""

    cluster: str
    threads: int = 1
    batch: int
    speed: dict[str, float]

    def __post_init__(self) -> None:
        check_range("host_speed.threads", self.threads, 1, 1024, kind="an integer")
        check_range("host_speed.batch", self.batch, 1, 2**40, kind="an integer")
        check(len(self.speed) >= 1, "host_speed.speed", self.speed, "at least one host")
        for host, v in self.speed.items():
            check_range(f"host_speed.speed.{host}", v, 0, 100, open_lo=True)


@dataclasses.dataclass(kw_only=True)
class Profile:
    version: int = VERSION
    workload: str
    model: dict = dataclasses.field(default_factory=dict)
    data: str | None = None
    threads: int = 1
    bucket_mb: float = 25.0
    parameters: int
    machine: dict = dataclasses.field(default_factory=dict)
    compute: list[ComputePoint]
    flops_per_sample: float = 0.0
    achieved_flops: float = 0.0
    activation_bytes_per_sample: float = 0.0
    buckets: list[BucketRecord]
    corun_speed: dict[str, float] = dataclasses.field(default_factory=dict)  # copies -> speed of each / fair share
    collective_cpu_s_per_byte: float = 0.0  # 0: not measured (thinwire.measure.collective)
    kernels: dict[str, Cost] = dataclasses.field(default_factory=dict)
    codecs: dict[str, CodecCost] = dataclasses.field(default_factory=dict)
    sync: dict[str, ConvergenceRecord] = dataclasses.field(default_factory=dict)  # the guard's sync modes (delayed)
    network: NetworkRecord | None = None
    host_speed: HostSpeedRecord | None = None  # measured on an emulated cluster (profile --cluster)
    aggregator: AggregatorRecord | None = None  # measured for a cluster with a switch (profile --cluster)
    layers: list[LayerRecord] = dataclasses.field(default_factory=list)  # the layer list's costs (pipelines)
    layers_batch: int = 0                                                 # the batch they were measured at
    runtime_bytes: int = 0  # a worker process's memory before its model: Python, torch, thinwire (0: not measured)
    pipeline_overhead_s: float = 0.0  # a stage's schedule and send/receive time per micro-batch (measure.pipeline_overhead)
    interleaved_overhead_s: float | None = None  # the same for a rank of 2 interleaved stages (None: not measured)
    val_items: int = 0  # the workload's validation set size (0: not recorded): what a validation can cost (plan)

    def __post_init__(self) -> None:
        check(self.version == VERSION, "version", self.version, f"{VERSION}",
              "The profile was written by another thinwire version; run `thinwire profile` again.")
        check(len(self.compute) >= 1, "compute", self.compute, "at least one measured batch size")
        check(len(self.buckets) >= 1, "buckets", self.buckets, "at least one bucket")
        check_range("threads", self.threads, 1, 1024, kind="an integer")
        check_range("bucket_mb", self.bucket_mb, 0, 4096, open_lo=True)
        check_range("parameters", self.parameters, 0, 2**62, kind="an integer")
        for name in ("flops_per_sample", "achieved_flops", "activation_bytes_per_sample"):
            check_range(name, getattr(self, name), 0, 1e30)
        check_range("collective_cpu_s_per_byte", self.collective_cpu_s_per_byte, 0, 1e-3)
        check_range("val_items", self.val_items, 0, 2**62, kind="an integer")
        check_range("pipeline_overhead_s", self.pipeline_overhead_s, 0, MAX_SECONDS)
        if self.interleaved_overhead_s is not None:
            check_range("interleaved_overhead_s", self.interleaved_overhead_s, 0, MAX_SECONDS)
        for copies, speed in self.corun_speed.items():
            check_range(f"corun_speed.{copies}", speed, 0, 100, open_lo=True)

    @property
    def guarded(self) -> bool:
        """Whether the convergence guard ran (some codec has a convergence record)."""
        return any(c.convergence is not None for c in self.codecs.values())

    def codec_cost(self, name: str) -> CodecCost:
        """Measured cost of codec ``name``; a clear error if the profile lacks it."""
        if name not in self.codecs:
            raise ThinwireError(f"profile: has no measured cost for codec {name!r} (it has "
                                f"{', '.join(repr(c) for c in sorted(self.codecs)) or 'no codecs'}). Run `thinwire profile ... --codecs "
                                f"{name}` to add it.")
        return self.codecs[name]


def save_profile(profile: Profile, path: str | Path) -> Path:
    return save_yaml(profile, path)


def load_profile(path: str | Path, *, flag: str | None = "--profile") -> Profile:
    """Read and check a profile; a missing file says how to make one (and, where leaving ``flag`` out measures
    one instead, so)."""
    return load_dataclass(Profile, path, what="profile", make=f"Make one with `thinwire profile --workload W --out "
                          f"{path}`" + (f", or leave {flag} out to measure now." if flag else "."))
