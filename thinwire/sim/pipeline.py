"""A pipelined run's predicted step from a cluster spec, a profile with per-layer costs, and a layout:
the plain inputs of :func:`thinwire.perf.pipeline.pipeline_step_s`.

* **Stage compute** per micro-batch: the profile's forward + backward seconds per sample of the stage's
  layers (:mod:`thinwire.measure.layers`) times the micro-batch, plus the schedule's own time per
  micro-batch (:mod:`thinwire.measure.pipeline_overhead`) and the host CPU of the bytes it sends and
  receives (the profile's collective CPU per byte), all over the host's speed (as for data parallelism,
  :func:`thinwire.sim.inputs.host_speeds`: its cores, co-located hosts sharing this machine).
* **Links**: a micro-batch's output of the stage before a cut, forward, and its gradient, back, in the
  link's activation format (:func:`thinwire.pipeline.wire.payload_bytes`); a host's egress carries its own
  outputs forward and its inputs' gradients back, at its bandwidth times TCP's payload share, plus the
  profile's latency per message.
* **After the schedule**: the optimizer's share of the profile's post-backward time for the stage's
  parameters, and, with replicas, the ring all-reduce of the stage's gradients among them (fp32).
"""

from __future__ import annotations

import dataclasses

from thinwire.cluster.spec import ClusterSpec, HostSpec
from thinwire.errors import ThinwireError
from thinwire.measure.file import DEFAULT_ALPHA_S, Profile
from thinwire.perf import collectives as coll
from thinwire.perf.pipeline import pipeline_step_s
from thinwire.pipeline.wire import payload_bytes
from thinwire.sim.inputs import compute_at, efficiency_of, host_cores, host_speeds


@dataclasses.dataclass
class PipelinePrediction:
    step_s: float
    stage_s: list[float]        # compute per micro-batch, per stage
    egress_s: list[float]       # sending per micro-batch, per stage's host
    link_s: list[float]         # one micro-batch across each link, forward and back
    after_s: float
    microbatches: int

    @property
    def bottleneck(self) -> str:
        c = max(range(len(self.stage_s)), key=lambda s: self.stage_s[s])
        e = max(range(len(self.egress_s)), key=lambda s: self.egress_s[s])
        if self.egress_s[e] > self.stage_s[c]:
            return f"stage {e}'s link ({self.egress_s[e] * 1e3:.1f} ms of sending per micro-batch)"
        return f"stage {c}'s compute ({self.stage_s[c] * 1e3:.1f} ms per micro-batch)"


def needs_layers(profile: Profile) -> None:
    if not profile.layers:
        raise ThinwireError(f"profile: has no per-layer costs of {profile.workload}'s layer list, which a pipeline is "
                            "priced by. Run `thinwire profile` again (this thinwire measures them for workloads with a "
                            "layer list).")


def stage_speeds(profile: Profile, hosts: list[HostSpec], *, replicas: int = 1, threads: int = 1,
                 colocated_cores: float | None = None) -> list[float]:
    """Each stage host's speed relative to the profile (``replicas`` copies of the hosts share the machine)."""
    cores = host_cores(hosts * replicas, threads=threads, colocated_cores=colocated_cores)[:len(hosts)]
    return host_speeds(cores, profile_threads=profile.threads, threads=threads, profile=profile,
                       colocated_cores=colocated_cores)


def stage_seconds(profile: Profile, runs: list[list[int]], speeds: list[float], micro: int,
                  recompute: bool = False) -> list[float]:
    """Each stage's forward and backward per micro-batch (and the forward again when activations are recomputed)."""
    per = [l.seconds + (l.forward_s if recompute else 0.0) for l in profile.layers]
    return [sum(per[i] for i in run) * micro / speed for run, speed in zip(runs, speeds)]


def cut_bytes(profile: Profile, run: list[int], codec: str, micro: int) -> float:
    """Bytes of a micro-batch's output of ``run``'s last layer (and of its gradient) in ``codec``."""
    last = profile.layers[run[-1]]
    return payload_bytes(codec, int(last.output_bytes * micro / 4), last.width)


def predict_pipeline(spec: ClusterSpec, profile: Profile, hosts: list[HostSpec], runs: list[list[int]], *,
                     microbatches: int, replica_batch: int, activations: list[str], replicas: int = 1,
                     threads: int = 1, colocated_cores: float | None = None, recompute: bool = False) -> PipelinePrediction:
    """The step of ``replicas`` pipelines over ``hosts`` (stage s of every replica on hosts like ``hosts[s]``)."""
    needs_layers(profile)
    S, micro = len(runs), replica_batch // microbatches
    speeds = stage_speeds(profile, hosts, replicas=replicas, threads=threads, colocated_cores=colocated_cores)
    efficiency = efficiency_of(profile)
    alpha = (profile.network.alpha_s if profile.network else DEFAULT_ALPHA_S) + max(
        (l.latency or 0.0 for l in spec.links), default=0.0)
    fwd = [cut_bytes(profile, runs[s], activations[s], micro) for s in range(S - 1)]  # link s: stage s -> s+1
    moved = [2 * ((fwd[s] if s < S - 1 else 0.0) + (fwd[s - 1] if s > 0 else 0.0)) for s in range(S)]  # in and out
    stage_s = [c + (profile.pipeline_overhead_s + profile.collective_cpu_s_per_byte * m) / v
               for c, m, v in zip(stage_seconds(profile, runs, speeds, micro, recompute), moved, speeds)]
    rate = [h.bandwidth / 8 * efficiency for h in hosts]
    egress = [((fwd[s] if s < S - 1 else 0.0) + (fwd[s - 1] if s > 0 else 0.0)) / rate[s]
              + alpha * ((s < S - 1) + (s > 0)) for s in range(S)]
    links = [fwd[s] / rate[s] + fwd[s] / rate[s + 1] + 2 * alpha for s in range(S - 1)]
    after = _after_s(profile, runs, speeds, replicas, hosts, efficiency, alpha)
    step = pipeline_step_s(stage_s=stage_s, egress_s=egress, link_s=links, microbatches=microbatches, after_s=after)
    return PipelinePrediction(step_s=step, stage_s=stage_s, egress_s=egress, link_s=links, after_s=after,
                              microbatches=microbatches)


def _after_s(profile: Profile, runs, speeds, replicas: int, hosts: list[HostSpec], efficiency: float,
             alpha: float) -> float:
    """The slowest stage's optimizer step and (with replicas) gradient all-reduce among its replicas."""
    post = compute_at(profile, profile.compute[0].batch).post_s
    worst = 0.0
    for s, run in enumerate(runs):
        params = sum(profile.layers[i].parameters for i in run)
        t = post * params / max(1, profile.parameters) / speeds[s]
        if replicas > 1:
            t += coll.ring_allreduce_s(params * 4, replicas, alpha=alpha,
                                       beta=coll.beta_from_rate(hosts[s].bandwidth, efficiency))
        worst = max(worst, t)
    return worst
