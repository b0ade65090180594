"""A pipelined run's predicted step from a cluster spec, a profile with per-layer costs, and a layout:
the plain inputs of :func:`thinwire.perf.pipeline.simulate_schedule`.

* **Stage compute** per micro-batch, forward and backward apart: the profile's time of each of the stage's
  layers for a call of the micro-batch (:mod:`thinwire.measure.layers`: a fixed part per call, the rest in
  proportion to the samples; backward also forwards again when activations are recomputed), forward's and
  backward's each scaled so the layers add up to the whole model's step measured at the same batch
  (:func:`layer_scales`), plus the
  schedule's own time per micro-batch
  (:mod:`thinwire.measure.pipeline_overhead`) and the host CPU of the bytes it sends and receives (the
  profile's collective CPU per byte), half to each, all over the host's speed: as ``thinwire profile
  --cluster`` measured it on that cluster's hosts, all computing at once (:mod:`thinwire.measure.hostspeed`;
  a 0.25-core quota runs this VM's steps at 0.18-0.19 of a core, not 0.24), else from its cores as for data
  parallelism (:func:`thinwire.sim.inputs.host_speeds`). That speed is sustained, computing without pause;
  a host with a ``cpu:`` quota (a CFS quota, 10 ms periods) may spend a period's quota at once, at full
  speed (the measured speed over the quota's cores): a stage whose micro-batch takes a few milliseconds,
  between waits for its neighbours, computes at full speed until its quota runs out and then waits for the
  next period (:class:`thinwire.perf.pipeline.CpuQuota`, :func:`cpu_quotas`); ``STEADY_STEPS`` steps are
  played back to back on the same periods and the first left out, so a step starts wherever the one before
  left its hosts' periods, as in training. On 4 hosts x 0.45 core the middle stages
  of a 4-stage charlm timed 4.1 ms per micro-batch (``summary.json``'s ``stage_compute``) where the
  sustained speed prices 8.5 ms and full speed 3.9 ms.
* **Links**: a micro-batch's output of the stage before a cut, forward, and its gradient, back, in the
  link's activation format (:func:`thinwire.pipeline.wire.payload_bytes`), each on its sender's egress at
  its bandwidth times TCP's payload share, one after another, and arriving a latency later: the probed
  one-way time of a small point-to-point message (``p2p_latency_s``, 0.1-0.3 ms between emulated hosts
  here; 0.1 ms unprobed) plus the spec's link latency. Where the probe found a token bucket on the links
  (``burst_bytes``: the emulator's tbf holds 32 KiB, or 2 ms of traffic above 131 Mbit/s), a message pays
  the rate only for what the credit its sender's link gathered while idle does not cover
  (:func:`thinwire.perf.pipeline.simulate_schedule`): at 100 Mbit/s a stage's 32 KiB of bf16 activations
  between idle gaps leave at once. The one probed link's bucket stands for every link's.
* **Interleaved** (``runs`` holding V stages per host, stage k on host ``k % S``): every stage priced as
  above on its host, each rank playing out the program torch's ``ScheduleInterleaved1F1B`` runs
  (:func:`thinwire.pipeline.programs.interleaved_programs`), its stages' messages on its host's one egress;
  the schedule's own time per micro-batch is the interleaved runtime's, measured apart (``profile``'s
  ``interleaved_overhead_s``, a rank of 2 stages: 3.5 ms here where 1F1B's stage takes 0.6 ms).
* **After the schedule**: the slowest stage's optimizer step (its share of the profile's post-backward
  time), the trainer's two scalar all-reduces of a step (the whole model's gradient norm over the stages,
  the mean loss over every rank) at a collective's latency per hop (the probe's ``alpha``), and, with
  replicas, the ring all-reduce of the stage's gradients among them (fp32).
"""

from __future__ import annotations

import dataclasses

from thinwire.cluster.cgroup import cpu_quota
from thinwire.cluster.spec import ClusterSpec, HostSpec
from thinwire.errors import ThinwireError
from thinwire.measure.file import DEFAULT_ALPHA_S, Profile
from thinwire.perf import collectives as coll
from thinwire.perf.pipeline import CpuQuota, simulate_schedule
from thinwire.pipeline.wire import payload_bytes
from thinwire.sim.inputs import compute_at, efficiency_of, host_cores, host_speeds, measured_speeds

STEADY_STEPS = 5  # steps simulated back to back; the first (quota periods fresh at its start) not counted


@dataclasses.dataclass
class PipelinePrediction:
    step_s: float
    stage_s: list[float]        # compute per micro-batch, per stage
    egress_s: list[float]       # sending per micro-batch, per host (stage k's is k % hosts)
    link_s: list[float]         # one micro-batch across each link, forward and back
    after_s: float
    microbatches: int
    send_s: list[float] = dataclasses.field(default_factory=list)  # sending per micro-batch, per stage

    @property
    def bottleneck(self) -> str:
        S = len(self.egress_s)
        busy = [sum(self.stage_s[r::S]) for r in range(S)]  # a host's compute per micro-batch, all its stages
        c = max(range(S), key=lambda r: busy[r])
        e = max(range(S), key=lambda r: self.egress_s[r])
        what = "stage" if len(self.stage_s) == S else "host of stage"
        if self.egress_s[e] > busy[c]:
            return f"{what} {e}'s link ({self.egress_s[e] * 1e3:.1f} ms of sending per micro-batch)"
        return f"{what} {c}'s compute ({busy[c] * 1e3:.1f} ms per micro-batch)"


def needs_layers(profile: Profile) -> None:
    if not profile.layers:
        raise ThinwireError(f"profile: has no per-layer costs of {profile.workload}'s layer list, which a pipeline is "
                            "priced by. Run `thinwire profile` again (this thinwire measures them for workloads with a "
                            "layer list).")


def stage_speeds(profile: Profile, hosts: list[HostSpec], *, replicas: int = 1, threads: int = 1,
                 colocated_cores: float | None = None, cluster: str | None = None) -> list[float]:
    """Each stage host's speed relative to the profile (``replicas`` copies of the hosts share the machine):
    as measured on ``cluster`` when the profile has its probe, else from the hosts' cores."""
    cores = host_cores(hosts * replicas, threads=threads, colocated_cores=colocated_cores)[:len(hosts)]
    return measured_speeds(profile, cluster, hosts, cores, threads) or host_speeds(
        cores, profile_threads=profile.threads, threads=threads, profile=profile, colocated_cores=colocated_cores)


def cut_bytes(profile: Profile, run: list[int], codec: str, micro: int) -> float:
    """Bytes of a micro-batch's output of ``run``'s last layer (and of its gradient) in ``codec``."""
    last = profile.layers[run[-1]]
    return payload_bytes(codec, int(last.output_bytes * micro / 4), last.width)


def predict_pipeline(spec: ClusterSpec, profile: Profile, hosts: list[HostSpec], runs: list[list[int]], *,
                     microbatches: int, replica_batch: int, activations: list[str], replicas: int = 1,
                     threads: int = 1, colocated_cores: float | None = None, recompute: bool = False,
                     schedule: str | None = None) -> PipelinePrediction:
    """The step of ``replicas`` pipelines over ``hosts`` (stage s of every replica on hosts like ``hosts[s]``;
    with ``schedule`` interleaved, ``runs`` holds V stages per host, stage k on ``hosts[k % len(hosts)]``);
    ``schedule`` None: 1F1B where it runs (M >= S), else GPipe, as the planner chooses."""
    needs_layers(profile)
    S, H, micro = len(runs), len(hosts), replica_batch // microbatches
    schedule = schedule or ("1f1b" if microbatches >= S else "gpipe")
    assert (schedule == "interleaved") == (S > H) and S % H == 0, (schedule, S, H)
    speeds = stage_speeds(profile, hosts, replicas=replicas, threads=threads, colocated_cores=colocated_cores,
                          cluster=spec.name)
    quota = cpu_quotas(hosts, replicas=replicas, threads=threads, colocated_cores=colocated_cores)
    after_speeds = [speeds[k % H] for k in range(S)]
    speeds = [speeds[k % H] / quota[k % H][0] for k in range(S)]  # each stage's host's, at full speed under its quota
    efficiency = efficiency_of(profile)
    latency = max((l.latency or 0.0 for l in spec.links), default=0.0)
    alpha = (profile.network.alpha_s if profile.network else DEFAULT_ALPHA_S) + latency  # a collective's per hop
    net = profile.network
    hand_off = (net.p2p_latency_s if net and net.p2p_latency_s is not None else DEFAULT_ALPHA_S) + latency
    fwd = [cut_bytes(profile, runs[s], activations[s], micro) for s in range(S - 1)]  # link s: stage s -> s+1
    moved = [2 * ((fwd[s] if s < S - 1 else 0.0) + (fwd[s - 1] if s > 0 else 0.0)) for s in range(S)]  # in and out
    overhead = profile.pipeline_overhead_s
    if schedule == "interleaved" and profile.interleaved_overhead_s is not None:
        overhead = profile.interleaved_overhead_s / 2  # measured for a rank of 2 stages: per stage
    extra = [(overhead + profile.collective_cpu_s_per_byte * m) / v / 2 for m, v in zip(moved, speeds)]
    wire_f, wire_b = _wire_s(profile, runs, activations, micro)
    lb = profile.layers_batch
    fscale, bscale = layer_scales(profile)
    fcall = [l.forward_call_s(micro, lb) * fscale for l in profile.layers]
    bcall = [l.backward_call_s(micro, lb) * bscale + (f if recompute else 0.0) for l, f in zip(profile.layers, fcall)]
    forward = [sum(fcall[i] for i in run) / v + e + w / v for run, v, e, w in zip(runs, speeds, extra, wire_f)]
    backward = [sum(bcall[i] for i in run) / v + e + w / v for run, v, e, w in zip(runs, speeds, extra, wire_b)]
    rate = [h.bandwidth / 8 * efficiency for h in hosts]
    burst = net.burst_bytes if net and net.burst_bytes is not None else 0.0
    send_f = [fwd[s] / rate[s % H] if s < S - 1 else 0.0 for s in range(S)]
    send_b = [fwd[s - 1] / rate[s % H] if s > 0 else 0.0 for s in range(S)]
    sends = [f + b + hand_off * ((s < S - 1) + (s > 0)) for s, (f, b) in enumerate(zip(send_f, send_b))]
    egress = [sum(sends[r::H]) for r in range(H)]
    links = [send_f[s] + send_b[s + 1] + 2 * hand_off for s in range(S - 1)]
    after = _after_s(profile, runs, after_speeds, replicas, hosts, efficiency, alpha)
    programs = None
    if schedule == "interleaved":
        from thinwire.pipeline.programs import interleaved_programs

        programs = interleaved_programs(H, S // H, microbatches)
    # steps back to back on the hosts' quota periods: a step starts wherever the last one left its periods
    cpus = [CpuQuota(*q) for q in quota]
    origin, steps = 0.0, []
    for _ in range(STEADY_STEPS):
        busy: list[float] = []
        for c in cpus:
            c.origin = origin
        step = simulate_schedule(forward_s=forward, backward_s=backward, send_forward_s=send_f,
                                 send_backward_s=send_b, microbatches=microbatches, schedule=schedule, alpha=hand_off,
                                 credit_s=[burst / r for r in rate], programs=programs, quota=cpus, busy_s=busy) + after
        steps.append(step)
        origin += step
    step = sum(steps[1:]) / (len(steps) - 1)
    return PipelinePrediction(step_s=step, stage_s=[b / microbatches for b in busy], egress_s=egress,
                              link_s=links, after_s=after, microbatches=microbatches, send_s=sends)


def cpu_quotas(hosts: list[HostSpec], *, replicas: int = 1, threads: int = 1,
               colocated_cores: float | None = None) -> list[tuple[float, float]]:
    """Each host's CPU quota as :class:`thinwire.perf.pipeline.CpuQuota` takes it: the share of full speed it
    sustains (its cores over its threads) and the seconds of full-speed work one period of its quota holds
    (``cpu:`` is a CFS quota, :func:`thinwire.cluster.cgroup.cpu_quota`); ``(1, 0)`` where it has none."""
    cores = host_cores(hosts * replicas, threads=threads, colocated_cores=colocated_cores)[:len(hosts)]
    out = []
    for h, c in zip(hosts, cores):
        if h.cpu is None or min(c, threads) >= threads:
            out.append((1.0, 0.0))
            continue
        quota_us, _ = cpu_quota(h.cpu)
        out.append((min(c, threads) / threads, quota_us / 1e6 / threads))
    return out


def layer_scales(profile: Profile) -> tuple[float, float]:
    """Forward's and backward's factor from the layers' costs, each timed on its own, to the whole model's
    step measured at the same batch (``compute``, when the profile has that batch): the layers give each
    stage's share, the whole step the total. They differ where the whole model's step costs what a layer
    alone does not show: charlm 8 x 512 (25M parameters), one sample, timed here 110 ms of backward where
    its layers add up to 78 ms (forward 43 ms both), while charlm 2 x 64 and 6 x 128 agree within 5%.
    ``(1, 1)`` without such a measurement."""
    whole = next((c for c in profile.compute if c.batch == profile.layers_batch), None)
    if whole is None or not profile.layers:
        return 1.0, 1.0
    b = profile.layers_batch
    fsum = sum(l.forward_call_s(b, b) for l in profile.layers)
    bsum = sum(l.backward_call_s(b, b) for l in profile.layers)
    return ((whole.forward_s / fsum if whole.forward_s > 0 and fsum > 0 else 1.0),
            (whole.backward_s / bsum if whole.backward_s > 0 and bsum > 0 else 1.0))


def _wire_s(profile: Profile, runs: list[list[int]], activations: list[str], micro: int) -> tuple[list, list]:
    """Each stage's seconds per micro-batch (at the profile's speed) in the links' formats
    (:mod:`thinwire.pipeline.wire`), forward and backward: a stage packs its output and unpacks its input
    going forward, packs its input's gradient and unpacks its output's going back. Zero for fp32 links, and
    where the profile predates these kernels (``wire_*`` in ``kernels``, measure.codec_costs.measure_wire)."""
    def cost(codec: str, kind: str, run: list[int]) -> float:
        k = profile.kernels.get(f"wire_{codec}_{kind}")
        return 0.0 if k is None else k.fixed_s + k.per_byte_s * profile.layers[run[-1]].output_bytes * micro

    S = len(runs)
    forward, backward = [0.0] * S, [0.0] * S
    for s in range(S - 1):  # link s: stage s -> s + 1, in activations[s]
        codec = activations[s]
        forward[s] += cost(codec, "pack", runs[s])
        forward[s + 1] += cost(codec, "unpack", runs[s])
        backward[s + 1] += cost(codec, "pack_grad", runs[s])
        backward[s] += cost(codec, "unpack", runs[s])
    return forward, backward


def _after_s(profile: Profile, runs, speeds, replicas: int, hosts: list[HostSpec], efficiency: float,
             alpha: float) -> float:
    """The slowest stage's optimizer step and (with replicas) gradient all-reduce among its replicas, then the
    step's two scalar all-reduces (``PipelineRank.grad_norm`` over the stages, the mean loss over every rank)."""
    post = compute_at(profile, profile.compute[0].batch).post_s
    worst = 0.0
    H = len(hosts)
    for r in range(H):  # a host's stages: r, r + H, ...
        params = sum(profile.layers[i].parameters for run in runs[r::H] for i in run)
        t = post * params / max(1, profile.parameters) / speeds[r]
        if replicas > 1:
            t += coll.ring_allreduce_s(params * 4, replicas, alpha=alpha,
                                       beta=coll.beta_from_rate(hosts[r].bandwidth, efficiency))
        worst = max(worst, t)
    S = H
    scalars = coll.ring_allreduce_s(8, S, alpha=alpha, beta=0.0) + coll.ring_allreduce_s(8, S * replicas, alpha=alpha,
                                                                                          beta=0.0)
    return worst + scalars
