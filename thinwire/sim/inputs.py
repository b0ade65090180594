"""Turn a cluster spec, a profile and a codec into the plain inputs of :func:`thinwire.perf.model.predict_step`.

This is the layer above perf/ that may read specs, profiles and codecs (DESIGN.md: perf/ is handed
plain values and callables):

* **Hosts at any count**: a spec of ``k`` hosts is scaled to ``p`` by repeating its hosts in order
  (host ``i`` is a copy of host ``i mod k``, in the same group), so a spec's mix of fast and slow
  hosts and links is kept at every scale. The ring visits the hosts group by group.
* **Speeds**: a host's speed is the cores it can use, relative to the profile's ``threads``:
  ``min(cpu, threads) / profile.threads``, with ``cpu: null`` meaning ``threads``. On an emulated
  cluster (``colocated_cores``: all hosts share this machine's cores) a host's cores are its
  max-min fair share of the machine (:func:`thinwire.perf.straggler.cpu_shares`), i.e.
  ``min(cpu, cores / hosts)`` when all caps are equal: four 1-core hosts on 2 cores run at 0.5.
  Busy cores can be slower than one core alone (SMT siblings, shared caches): co-located hosts
  also run at the profile's measured ``corun_speed`` (:func:`thinwire.perf.straggler.corun_factor`).
* **Network**: the ring's pace is its slowest edge (:func:`thinwire.perf.collectives.ring_edge_rates`),
  at the profile's measured efficiency and latency (defaults when it has no network probe: TCP's
  1448/1514 payload share and 100 us), and the profile's measured host CPU per byte of a collective.
* **Compute**: the profile's phases at the per-rank batch, the measured point when there is one,
  else the line in the batch size through the measured points (slope >= 0).
* **Offload engines** (spec ``nic:``): on a host with one, codec work and the collectives' host CPU run
  on the engine's cores (:func:`engine_codec`), not taken from compute.
* **Codec**: the traffic its own scheme states (:mod:`thinwire.compress.schemes`: collectives,
  bytes and codec work, from the bucket's parameter shapes where the scheme needs them) and the
  profile's measured encode/decode/add/feedback costs.
"""

from __future__ import annotations

import dataclasses
import math
import statistics


from thinwire.cluster.spec import ClusterSpec, HostSpec
from thinwire.compress import schemes
from thinwire.compress.codecs import Codec
from thinwire.compress.spec import parse_codec_spec, spec_string
from thinwire.config import check
from thinwire.errors import ConfigError, ThinwireError
from thinwire.perf import collectives as coll
from thinwire.perf.fit import monotone_line
from thinwire.perf.model import Bucket, CodecModel, Compute, LinearCost, Network
from thinwire.perf.straggler import corun_factor, cpu_shares
from thinwire.measure.file import DEFAULT_ALPHA_S, TCP_EFFICIENCY, Cost, Profile

MAX_HOSTS = 65536


def engine_codec(hosts: list[HostSpec], speeds: list[float], cores: list[float], threads: int) -> tuple[float, bool]:
    """``(codec_speed, steals)`` for :func:`thinwire.perf.model.predict_step`, from the slowest host: with an
    offload engine (``nic:``) its codec work and collectives' CPU run on the engine's cores (one thread, so
    at most speed 1) and take nothing from compute; without one they run at the host's own speed (at most
    1) and, with no core to spare beside the compute threads, take their time from backward."""
    slow = speeds.index(min(speeds))
    nic = hosts[slow].nic
    if nic is not None:
        return min(1.0, nic.cpu), False
    return min(1.0, speeds[slow]), cores[slow] < threads + 1


def replicate_hosts(spec: ClusterSpec, p: int) -> list[HostSpec]:
    """``p`` hosts: host ``i`` copies ``spec.hosts[i % k]``; ordered group by group (the ring's order)."""
    check(isinstance(p, int) and 1 <= p <= MAX_HOSTS, "--hosts", p, f"host counts in [1, {MAX_HOSTS}]")
    k = len(spec.hosts)
    hosts = [dataclasses.replace(spec.hosts[i % k], name=f"{spec.hosts[i % k].name}-{i // k}" if p > k else
                                 spec.hosts[i].name) for i in range(p)]
    order = {g: j for j, g in enumerate(spec.groups)}
    return sorted(hosts, key=lambda h: order[h.group])


def host_cores(hosts: list[HostSpec], *, threads: int, colocated_cores: float | None = None) -> list[float]:
    """Cores each host computes with (see the module docstring)."""
    if colocated_cores:
        return cpu_shares([h.cpu for h in hosts], colocated_cores)
    return [h.cpu if h.cpu is not None else float(threads) for h in hosts]


def host_speeds(cores: list[float], *, profile_threads: int, threads: int, profile: Profile | None = None,
                colocated_cores: float | None = None) -> list[float]:
    """Speed relative to the profile: the cores a host's ``threads`` threads can use, over the profile's;
    co-located hosts also run at the measured speed of a core while the others are busy."""
    speeds = [min(c, threads) / profile_threads for c in cores]
    if colocated_cores and profile is not None and profile.corun_speed:
        corun = {int(k): v for k, v in profile.corun_speed.items()}
        # a host's process keeps at most its threads busy, whatever share of the cores it may have
        factor = corun_factor([min(c, threads) for c in cores], math.ceil(colocated_cores), corun)
        speeds = [v * factor for v in speeds]
    return speeds


def measured_speeds(profile: Profile | None, cluster: str | None, hosts: list[HostSpec], cores: list[float],
                    threads: int) -> list[float] | None:
    """The hosts' speeds as ``thinwire profile --cluster`` measured them on this cluster, all at once
    (:mod:`thinwire.measure.hostspeed`: quota and co-running included), scaled from the probe's threads to
    ``threads``; None where the profile has no such probe for every one of them (then :func:`host_speeds`).
    The pipeline model takes them (its stages run a micro-batch at a time, between hand-offs, where a
    quota costs most); data parallelism's model, validated with cores and the co-run factor
    (``benchmarks/results/validation_probe.md``), does not yet."""
    rec = profile.host_speed if profile is not None else None
    if rec is None or cluster != rec.cluster or any(h.name not in rec.speed for h in hosts):
        return None
    return [rec.speed[h.name] * min(c, threads) / min(c, rec.threads) for h, c in zip(hosts, cores)]


def hierarchical_s(spec: ClusterSpec, hosts: list[HostSpec], nbytes: float, net: Network, efficiency: float) -> float:
    """Two-level all-reduce of ``nbytes`` over the spec's groups (what-if; thinwire's hook uses a ring)."""
    groups = sorted({h.group for h in hosts})
    g = max(1, len(hosts) // len(groups))
    intra = min(h.bandwidth for h in hosts)
    inter = min([l.bandwidth for l in spec.links] or [intra])
    return coll.hierarchical_allreduce_s(nbytes, g, len(groups), alpha_in=net.alpha_s,
                                         beta_in=coll.beta_from_rate(intra, efficiency), alpha_out=net.alpha_s,
                                         beta_out=g * coll.beta_from_rate(inter, efficiency))


def efficiency_of(profile: Profile) -> float:
    return profile.network.efficiency if profile.network else TCP_EFFICIENCY


def _per_trainer(rec) -> tuple[float, float] | None:
    """The profile's measured aggregator CPU (``bucket + value * numel`` from its trainers) per trainer."""
    return None if rec is None else (rec.per_bucket_s / rec.trainers, rec.per_value_s / rec.trainers)


def ring_network(spec: ClusterSpec, hosts: list[HostSpec], profile: Profile, busy_hop_s: float | None = None) -> Network:
    """Alpha and the slowest edge's beta of the ring over ``hosts`` (spec links shared as the spec says);
    ``busy_hop_s``: a ring hop's wait for CPU quotas while the hosts compute (``cluster bench --busy``;
    None: the profile's, measured with ``profile --cluster``, else none)."""
    links = {link.pair: link.bandwidth for link in spec.links}
    rates = coll.ring_edge_rates([h.bandwidth for h in hosts], [h.group for h in hosts], links)
    net = profile.network
    efficiency = efficiency_of(profile)
    alpha = net.alpha_s if net else DEFAULT_ALPHA_S
    groups = {h.group for h in hosts}  # a link's latency slows only the rings that cross it
    latency = max((l.latency or 0.0 for l in spec.links if l.pair <= groups), default=0.0)
    if busy_hop_s is None:
        busy_hop_s = (net.busy_hop_s or 0.0) if net else 0.0
    # the switch's aggregator (spec ``switch:``) runs one thread on its own cores; no cap: one core
    switch_speed = min(1.0, spec.switch.cpu or 1.0) if spec.switch is not None else None
    return Network(alpha_s=alpha + latency, beta_s_per_byte=coll.ring_beta(rates, efficiency),
                   cpu_s_per_byte=profile.collective_cpu_s_per_byte, busy_hop_s=busy_hop_s, switch_speed=switch_speed,
                   switch_cpu=_per_trainer(profile.aggregator),
                   switch_trainer_cpu=profile.aggregator.trainer_cpu if profile.aggregator else None)


def compute_at(profile: Profile, batch: float) -> Compute:
    """Phases at per-rank ``batch``: the measured point if there is one, else :func:`compute_line`."""
    check(batch >= 1, "--batch-size", batch, "at least one sample per host",
          "Use a larger --batch-size or --scaling weak.")
    exact = next((c for c in profile.compute if c.batch == batch), None)
    if exact is not None:
        return Compute(pre_s=exact.pre_s, backward_s=exact.backward_s, post_s=exact.post_s, std_s=exact.std_s)
    return compute_line(profile, batch)


def one_point_note(profile: Profile, batches) -> str | None:
    """Where the profile measured compute at one batch size and ``batches`` (per host) holds others: a note that
    they are priced in proportion to it (:func:`compute_line` through one point: no cost per step that does not
    grow with the batch, so a smaller share looks that much faster), and how to measure a line; else None."""
    sizes = {c.batch for c in profile.compute}
    others = sorted({b for b in batches if b not in sizes})
    if len(sizes) != 1 or not others:
        return None
    (b,) = sizes
    more = sorted({b, *(max(1, round(x)) for x in (others[0], others[-1]))})
    return (f"the profile measured compute at one batch size ({b:g} per host); {', '.join(f'{x:g}' for x in others)} "
            "per host are priced in proportion to it, leaving out any cost per step that does not grow with the batch. "
            f"Profile with --batch-sizes {','.join(f'{x:g}' for x in more)} to price them from a line.")


def compute_line(profile: Profile, batch: float) -> Compute:
    """Phases at ``batch`` on the line through every measured point (:func:`thinwire.perf.fit.monotone_line`:
    a host never looks faster with more samples), below the smallest measured batch at least in proportion to
    it; clip + optimizer and the noise do not depend on the batch: their medians."""
    pts = profile.compute
    smallest = min(pts, key=lambda c: c.batch)

    def at(phase: str) -> float:
        intercept, slope = monotone_line([(c.batch, getattr(c, phase)) for c in pts])
        line = max(0.0, intercept + slope * batch)
        if batch < smallest.batch:  # below what was measured a fitted line's negative intercept prices a few samples
            # as nearly free; a fixed cost per step (>= 0) makes time at least in proportion to the smallest point's
            return max(line, getattr(smallest, phase) * batch / smallest.batch)
        return line

    return Compute(pre_s=at("pre_s"), backward_s=at("backward_s"), post_s=statistics.median(c.post_s for c in pts),
                   std_s=statistics.median(c.std_s for c in pts))


def buckets_of(profile: Profile, bucket_mb: float | None = None) -> list[Bucket]:
    if bucket_mb is not None and abs(bucket_mb - profile.bucket_mb) > 1e-9:
        raise ConfigError("bucket_mb", bucket_mb, f"the profile's bucket cap ({profile.bucket_mb:g} MB)",
                          f"Profile again with --bucket-mb {bucket_mb:g}: the bucket layout is measured.")
    return [Bucket(numel=b.numel, ready_frac=b.ready_frac) for b in profile.buckets]


def _cost(c: Cost) -> LinearCost:
    return LinearCost(fixed_s=c.fixed_s, per_byte_s=c.per_byte_s)


def codec_model(spec: str | Codec, profile: Profile | None, *, min_compress_bytes: int = 4096,
                shapes: list[list[list[int]]] | None = None, switch: bool = False) -> CodecModel:
    """The :class:`CodecModel` of codec ``spec`` (a spec string or a codec) with the profile's measured
    costs (zero without a profile: bytes only). Its traffic is the codec's own scheme's
    (:func:`thinwire.compress.schemes.traffic`), fp32 for buckets under ``min_compress_bytes`` as the
    hook sends them. ``shapes``: parameter shapes per bucket (default: the profile's buckets; a bucket
    without them is priced from its size alone). ``switch``: int8 through the aggregator on the switch."""
    codec = parse_codec_spec(spec) if isinstance(spec, str) else spec
    name = spec_string(codec)
    if shapes is None:
        shapes = [b.shapes for b in profile.buckets] if profile is not None else []

    def traffic(index: int, numel: int, p: int):
        small = codec.lossless or numel * 4 < min_compress_bytes
        return schemes.traffic(codec, numel, p, shapes[index] if index < len(shapes) else None, uncompressed=small,
                               switch=switch)

    return CodecModel(name=name, traffic=traffic, **_measured_costs(name, codec, profile))


def _measured_costs(name: str, codec: Codec, profile: Profile | None) -> dict[str, LinearCost]:
    if profile is None or codec.lossless:
        return {}
    measured = profile.codec_cost(name)
    return dict(encode=_cost(measured.encode), decode=_cost(measured.decode),
                **{k: _cost(profile.kernels[k]) for k in ("add", "feedback") if k in profile.kernels})


def check_profile_matches(profile: Profile, workload: str, model: dict, *, parameters: int | None = None,
                          what: str = "the simulation") -> None:
    """The profile measured this workload's model: options compared with the workload's defaults filled in
    (``layers=2`` given or left out is the same model). Given ``parameters`` (the model the workload builds now),
    a profile of another size is warned about: a user's workload changed since it was profiled has the same name
    and options, and every time and byte the profile holds is of the other model."""
    from thinwire.workloads.registry import model_defaults

    defaults = model_defaults(workload)  # the same filling as plan's (thinwire.plan.planfile.normalized_model)
    if profile.workload != workload or {**defaults, **profile.model} != {**defaults, **dict(model)}:
        raise ThinwireError(f"profile: measured workload {profile.workload!r} with model options {profile.model}, "
                            f"but {what} asks for {workload!r} with {dict(model)}. Profile this workload "
                            "with `thinwire profile` or pass the matching --profile.")
    if parameters is not None and parameters != profile.parameters:
        import sys

        print(f"warning: the profile measured {workload!r} with {profile.parameters:,} parameters, but it builds "
              f"{parameters:,} now (its code or options changed since): every time and byte the profile holds is of "
              "the other model. Profile it again with `thinwire profile`.", file=sys.stderr, flush=True)
