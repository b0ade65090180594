"""``simulate``: predicted step, scaling, bytes, memory and energy of a workload on a cluster spec.

For each host count ``p`` the spec is scaled to ``p`` hosts (:func:`~thinwire.sim.inputs.replicate_hosts`)
and :func:`thinwire.perf.model.predict_step` prices one step. Scaling:

* ``weak`` (default): every host keeps the per-host batch the spec's own host count would get from
  ``batch_size`` (``batch_size / k``), so the global batch grows with ``p``;
* ``strong``: the global batch stays ``batch_size`` and is split over ``p`` hosts (what
  ``thinwire train`` does for a given spec).

``speedup(p)`` is the throughput (samples/s) over that of one speed-1 host (the profiled machine)
computing alone what one host computes: the same per-host batch (``weak``), or the whole global batch
(``strong``: the step one host would take, over this one); ``efficiency = speedup / p``. Energy uses a device from
:mod:`thinwire.perf.devices` (per core for ``cpu-core`` devices, times the host's cores).
"""

from __future__ import annotations

import dataclasses

from thinwire.cluster.spec import ClusterSpec
from thinwire.config import check, check_range
from thinwire.perf import collectives as coll
from thinwire.perf.devices import get_device
from thinwire.perf.energy import EnergyEstimate, J_PER_BIT_INTERNET, run_energy, step_energy
from thinwire.perf.memory import MemoryEstimate, memory_per_rank
from thinwire.perf.model import StepPrediction, predict_step
from thinwire.compress.sync import StepParts
from thinwire.compress.sync import kind as sync_kind
from thinwire.measure.file import Profile
from thinwire.sim import inputs


@dataclasses.dataclass(kw_only=True)
class SimOptions:
    codec: str = "none"
    hosts: list[int] | None = None        # None: the spec's own host count
    batch_size: int | None = None         # global batch at the spec's host count (weak) or at every count (strong)
    scaling: str = "weak"
    threads: int | None = None            # torch threads per worker; None: the profile's
    colocated_cores: float | None = None  # all hosts share this many cores (an emulated cluster)
    device: str = "xeon-8380-core"
    mfu: float | None = None              # compute from the device's peak at this utilization, not the profile
    j_per_bit: float = J_PER_BIT_INTERNET
    steps: int = 1000
    bucket_mb: float | None = None
    sync: object = None                   # a parsed --sync (thinwire.syncspec.SyncSpec); None: allreduce
    busy_hop_s: float | None = None       # a ring hop's wait for CPU quotas while hosts compute; None: the profile's
    aggregation: str = "ring"             # switch: int8 buckets through the aggregator on the switch

    def __post_init__(self) -> None:
        check(self.scaling in ("weak", "strong"), "--scaling", self.scaling, "weak or strong")
        check_range("--steps", self.steps, 1, 10**12, kind="an integer")
        check_range("--threads", self.threads, 1, 1024, kind="an integer")
        check_range("--colocated", self.colocated_cores, 0, 4096, kind="a number of cores", open_lo=True)
        check(self.mfu is None or 0 < self.mfu <= 1, "--mfu", self.mfu, "a fraction of peak in (0, 1]",
              "0.3-0.5 is typical for training; leave it out to use the profile's measured compute.")
        check_range("--j-per-bit", self.j_per_bit, 0, 1, kind="joules per bit",
                    fix=f"The internet's is about {J_PER_BIT_INTERNET:.1e} (Aslan et al. 2018, 0.06 kWh/GB); "
                        "leave it out for that default.")
        get_device_checked(self.device)
        check(self.aggregation in ("ring", "switch"), "--aggregation", self.aggregation, "ring or switch")
        if self.aggregation == "switch":
            from thinwire.compress.schemes.switched import switchable

            check(switchable(self.codec), "--compression", self.codec,
                  "int8 (nearest rounding) with --aggregation switch", "Other codecs travel around the ring.")


def get_device_checked(name: str):
    """The device table entry, or a ConfigError listing the known devices."""
    from thinwire.errors import ConfigError
    from thinwire.perf.devices import DEVICES

    if name not in DEVICES:
        raise ConfigError("--device", name, f"one of {', '.join(DEVICES)}", "See thinwire/perf/devices.py for sources.")
    return get_device(name)


@dataclasses.dataclass
class Point:
    """One host count's prediction and what follows from it."""

    p: int
    batch_per_host: float
    prediction: StepPrediction
    speedup: float
    efficiency: float
    energy_step: EnergyEstimate
    energy_run: EnergyEstimate
    memory: MemoryEstimate
    dense_allreduce_s: dict[str, float]
    sync_mode: str = "allreduce"
    sync_step_s: float = 0.0            # the step of the sync mode (allreduce: the predicted step)
    sync_bytes_per_step: float = 0.0    # bytes each rank sends per step in that mode

    @property
    def sync_speedup(self) -> float:
        return self.speedup * self.prediction.step_s / self.sync_step_s

    def to_dict(self) -> dict:
        pr = self.prediction
        return {
            "hosts": self.p, "batch_per_host": self.batch_per_host, "step_s": pr.step_s, "compute_s": pr.compute_s,
            "exposed_comm_s": pr.exposed_comm_s, "comm_s": pr.comm_s, "codec_s": pr.codec_s, "noise_s": pr.noise_s,
            "bytes_per_rank": pr.bytes_per_rank, "speedup": self.speedup, "efficiency": self.efficiency,
            "energy_step_j": self.energy_step.total_j, "energy_run_j": self.energy_run.total_j,
            "energy_network_step_j": self.energy_step.network_j, "memory_per_rank_bytes": self.memory.total,
            "memory": dataclasses.asdict(self.memory), "dense_fp32_allreduce_s": self.dense_allreduce_s,
            "buckets": [{"numel": b.numel, "scheme": b.scheme, "bytes_sent": b.bytes_sent, "comm_s": b.comm_s,
                         "encode_s": b.encode_s, "decode_s": b.decode_s, "collectives": b.collectives,
                         "ready_s": s.ready_s, "start_s": s.start_s, "done_s": s.done_s}
                        for b, s in zip(pr.buckets, pr.timeline.buckets)],
            "sync": self.sync_mode, "sync_step_s": self.sync_step_s, "sync_bytes_per_step": self.sync_bytes_per_step,
            "sync_speedup": self.sync_speedup, "backward_end_s": pr.timeline.backward_s, "pre_s": pr.timeline.pre_s, "post_s": pr.timeline.post_s,
        }


def per_host_batch(opts: SimOptions, profile: Profile, k: int, p: int, default_batch: int) -> float:
    batch = opts.batch_size or default_batch
    hosts = k if opts.scaling == "weak" else p
    check(batch >= hosts, "--batch-size", batch, f"at least one sample per host ({hosts} hosts"
          + (" with --scaling strong)" if opts.scaling == "strong" else ", the spec's)"),
          f"{batch} over {hosts} hosts is {batch / hosts:g} each. Use a larger --batch-size"
          + (", fewer --hosts or --scaling weak." if opts.scaling == "strong" else "."))
    return batch / hosts


def simulate(spec: ClusterSpec, profile: Profile, opts: SimOptions, *, default_batch: int) -> list[Point]:
    """Predictions for each host count in ``opts.hosts`` (see the module docstring)."""
    codec = inputs.codec_model(opts.codec, profile, switch=opts.aggregation == "switch")
    buckets = inputs.buckets_of(profile, opts.bucket_mb)
    threads = opts.threads or profile.threads
    device = get_device_checked(opts.device)
    out = []
    for p in opts.hosts or [len(spec.hosts)]:
        hosts = inputs.replicate_hosts(spec, p)
        b = per_host_batch(opts, profile, len(spec.hosts), p, default_batch)
        compute = inputs.compute_at(profile, b)
        cores = inputs.host_cores(hosts, threads=threads, colocated_cores=opts.colocated_cores)
        speeds = inputs.host_speeds(cores, profile_threads=profile.threads, threads=threads, profile=profile,
                                    colocated_cores=opts.colocated_cores)
        # one speed-1 host alone (the profiled machine, or one `device`) on its batch; strong: on the whole
        # global batch, a p-th of its time per host (speedup p * reference / step: one host's step over this one)
        alone = compute.total_s if opts.scaling == "weak" else inputs.compute_at(profile, b * p).total_s / p
        reference_s = alone
        if opts.mfu:  # every host is a `device` (from FLOPs), at its share of it (cpu:), as plan prices it
            on_device = device.compute_s(profile.flops_per_sample * b, utilization=opts.mfu)
            speeds, reference_s = [s * compute.total_s / on_device for s in speeds], on_device * alone / compute.total_s
        net = inputs.ring_network(spec, hosts, profile, opts.busy_hop_s)
        # the slowest host's codec work: on its offload engine, or competing with backward without a spare core
        codec_speed, steals = inputs.engine_codec(hosts, speeds, cores, threads)
        pred = predict_step(buckets=buckets, compute=compute, speeds=speeds, network=net, codec=codec,
                            codec_speed=codec_speed, codec_steals_compute=steals)
        point = _point(p, b, pred, compute.total_s, reference_s, speeds, cores, hosts, device, opts, profile, codec, net, spec)
        out.append(_with_sync(point, opts, steals))
    return out


def _with_sync(point: Point, opts: SimOptions, steals: bool) -> Point:
    """The sync mode's step, priced by the class that runs it, from the predicted allreduce step's parts."""
    pr = point.prediction
    if opts.sync is None:
        point.sync_mode, point.sync_step_s, point.sync_bytes_per_step = "allreduce", pr.step_s, float(pr.bytes_per_rank)
        return point
    mode = sync_kind(opts.sync)
    parts = StepParts(allreduce_step_s=pr.step_s, compute_s=pr.compute_s + pr.noise_s, comm_s=pr.comm_s,
                      codec_s=pr.codec_s, codec_steals_compute=steals, hosts=pr.p)
    point.sync_mode = opts.sync.mode
    point.sync_step_s = mode.step_s(opts.sync, parts)
    point.sync_bytes_per_step = mode.bytes_per_step(opts.sync, pr.bytes_per_rank, hosts=pr.p)
    return point


def _point(p, b, pred, compute_unit_s, reference_s, speeds, cores, hosts, device, opts, profile, codec, net, spec) -> Point:
    speedup = p * reference_s / pred.step_s  # samples/s over those of one reference host alone
    busy = [min(pred.step_s, compute_unit_s / s + pred.codec_s) for s in speeds]
    units = sum(cores) if device.kind == "cpu-core" else p  # power per core, or per device
    step_e = step_energy(busy_s=busy, step_s=pred.step_s, busy_w=device.busy_w * units / p,
                         idle_w=device.idle_w * units / p, bytes_sent=pred.bytes_per_rank * p,
                         j_per_bit=opts.j_per_bit)
    numels = [bk.numel for bk in pred.buckets]
    mem = memory_per_rank(sum(numels), residual_values=sum(bk.residual_values for bk in pred.buckets),
                          activation_bytes=int(profile.activation_bytes_per_sample * b),
                          runtime_bytes=int(profile.runtime_bytes or 0))
    n = 4 * sum(numels)
    dense = {"ring": coll.ring_allreduce_s(n, p, alpha=net.alpha_s, beta=net.beta_s_per_byte),
             "halving_doubling": coll.halving_doubling_allreduce_s(n, p, alpha=net.alpha_s, beta=net.beta_s_per_byte),
             "in_network": coll.parameter_server_s(n, p, alpha=net.alpha_s, beta_host=net.beta_s_per_byte,
                                                   beta_server=0.0)}
    if len(spec.groups) > 1:
        dense["hierarchical"] = inputs.hierarchical_s(spec, hosts, n, net, inputs.efficiency_of(profile))
    return Point(p=p, batch_per_host=b, prediction=pred, speedup=speedup, efficiency=speedup / p,
                 energy_step=step_e, energy_run=run_energy(step_e, opts.steps), memory=mem, dense_allreduce_s=dense)
