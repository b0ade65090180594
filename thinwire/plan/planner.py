"""``thinwire plan``: from a cluster spec, a workload profile and a global batch to a plan file.

Steps of :func:`make_plan`:

1. **Hosts as the model sees them** (the simulator's conventions, :mod:`thinwire.sim.inputs`): speed
   = cores it computes with over the profile's threads (``cpu`` in the spec; on an emulated cluster,
   its fair share of this machine's cores); compute phases at any per-rank batch on a line through
   the profile's measured points, or scaled to a device of :mod:`thinwire.perf.devices`
   at a utilization (``device``/``mfu``).
2. **Memory** (:mod:`thinwire.perf.memory`, ZeRO's accounting): parameters, gradients, AdamW state,
   DDP's bucket copy, error-feedback residuals when the host compresses, activations per sample
   from the profile. The largest micro-batch that fits is the host's cap; a host that cannot hold
   the model with one sample is left out. If no host can (or with ``--pipeline``), a pipeline over the
   hosts is planned instead (:mod:`thinwire.plan.pipeline`: the layer list split by host speed and
   memory, each link's activation format); if even that does not fit, the model fits nowhere.
3. **Search** (:mod:`thinwire.plan.search`): host subsets, groupings, balanced shares, per-bucket
   codecs, scored by the performance model; uniform DDP with every single codec is always scored,
   so the chosen plan is never predicted slower than uniform DDP fp32.
4. **Explain** (:mod:`thinwire.plan.explain`) and write (:mod:`thinwire.plan.planfile`).

Example::

    plan = make_plan(load_cluster_spec("examples/clusters/plan-a-slow-cpu.yaml"), load_profile("p.yaml"),
                     workload="charlm", model={}, options=PlanOptions(batch_size=32))
    save_plan(plan, "plan.yaml")
"""

from __future__ import annotations

import dataclasses
import time

from thinwire.cluster.spec import ClusterSpec
from thinwire.compress.spec import default_candidates
from thinwire.config import check, check_range
from thinwire.errors import ThinwireError
from thinwire.perf.memory import memory_per_rank, residual_values
from thinwire.perf.model import Bucket, Compute
from thinwire.measure.file import DEFAULT_ALPHA_S, REACH_TOL, Profile
from thinwire.plan import explain
from thinwire.plan.choose import MAX_EF_ERROR
from thinwire.plan.planfile import (Decision, Plan, cluster_fingerprint, host_summary, normalized_model,
                                    workload_fingerprint)
from thinwire.plan.search import HostModel, Problem, Scored, search, uniform
from thinwire.sim import inputs



@dataclasses.dataclass(kw_only=True)
class PlanOptions:
    batch_size: int
    # lightest first: on a tie the lighter codec (closer to fp32 numerics) wins; by default the
    # candidates ``auto`` tries too
    codecs: tuple[str, ...] = dataclasses.field(default_factory=default_candidates)
    threads: int | None = None            # torch threads per worker (default: the profile's)
    colocated_cores: float | None = None  # all hosts share this many cores (an emulated cluster)
    device: str | None = None             # with mfu: compute from this device's peak, not the profile's time
    mfu: float | None = None
    keep: int = 6                         # alternatives kept in the plan file
    min_gain: float = 0.02
    optimizer: str = "adamw"
    max_error: float = MAX_EF_ERROR       # with --rank step (or no guard): the cap on a codec's relative error with EF
    rank: str = "time"                    # "time": by predicted time to fp32's loss (the guard's factors); "step"
    pipeline: bool = False                # plan a pipeline over the hosts (also when data parallelism fits)
    eval_every: int = 0                   # the run validates every this many steps (0: validation not priced)
    eval_batches: int = 20                # ... on this many global batches (0: the whole validation set)

    def __post_init__(self) -> None:
        check(self.batch_size >= 1, "--batch-size", self.batch_size, "an integer >= 1")
        check("none" in self.codecs, "--codecs", ",".join(self.codecs), "a list that includes none",
              "Uniform DDP fp32 (none) is always a candidate.")
        check_range("--threads", self.threads, 1, 1024, kind="an integer")
        check_range("--colocated", self.colocated_cores, 0, 4096, kind="a number of cores", open_lo=True)
        check((self.device is None) == (self.mfu is None), "--mfu", self.mfu, "given together with --device")
        check(self.mfu is None or 0 < self.mfu <= 1, "--mfu", self.mfu, "a fraction of peak in (0, 1]")
        check_range("--keep", self.keep, 1, 1000, kind="an integer")
        check_range("--max-error", self.max_error, 0, 1e6, kind="a relative error", open_lo=True,
                    fix=f"The default is {MAX_EF_ERROR}.")
        check(self.rank in ("time", "step"), "--rank", self.rank, "time or step",
              "time: by predicted time to DDP fp32's loss (step x the guard's sample factor); step: by step time.")
        check_range("--eval-every", self.eval_every, 0, 10**9, kind="an integer (0: validation not priced)")
        check_range("--eval-batches", self.eval_batches, 0, 10**9, kind="an integer (0: the whole validation set)")


# -- inputs ----------------------------------------------------------------------------------------------
def check_profile(profile: Profile, workload: str, model: dict) -> None:
    mine, theirs = normalized_model(workload, model), normalized_model(profile.workload, profile.model)
    if profile.workload != workload or mine != theirs:
        raise ThinwireError(f"profile: measured workload {profile.workload!r} with model options {theirs}, but the "
                            f"plan asks for {workload!r} with {mine}. Profile this workload with `thinwire profile` "
                            "or pass the matching --profile.")


def fitted_compute(profile: Profile, batch: int) -> Compute:
    """Phases at ``batch`` on the profile's line (:func:`thinwire.sim.inputs.compute_line`), never the
    exact measured point: noise in one point would otherwise make equal hosts get unequal shares."""
    return inputs.compute_line(profile, batch)


def compute_fn(profile: Profile, opts: PlanOptions):
    """Per-rank batch -> phases at speed 1: the profile's line (:func:`fitted_compute`), or scaled to
    ``opts.device`` at ``opts.mfu``."""
    memo: dict[int, Compute] = {}
    device = None
    if opts.device is not None:
        from thinwire.sim.sweep import get_device_checked

        device = get_device_checked(opts.device)

    def at(batch: int) -> Compute:
        if batch not in memo:
            c = fitted_compute(profile, batch)
            if device is not None:
                f = device.compute_s(profile.flops_per_sample * batch, utilization=opts.mfu) / max(c.total_s, 1e-12)
                c = Compute(pre_s=c.pre_s * f, backward_s=c.backward_s * f, post_s=c.post_s * f, std_s=c.std_s * f)
            memo[batch] = c
        return memo[batch]

    return at


def static_bytes(profile: Profile, opts: PlanOptions, *, compressed: bool, p: int) -> int:
    """A rank's bytes before activations: the training state and the process itself (Python, torch, gloo:
    the profile's measured ``runtime_bytes``, which a host's memory limit counts too)."""
    numels = [b.numel for b in profile.buckets]
    resid = residual_values(numels, compressed=compressed, p=p, reduced_chunk=compressed)
    return memory_per_rank(profile.parameters, optimizer=opts.optimizer, residual_values=resid).total + profile.runtime_bytes


def micro_cap(memory: int | None, static: int, per_sample: float) -> int | None:
    """Largest micro-batch whose activations fit beside ``static`` bytes (None: no limit; 0: none fits)."""
    if memory is None:
        return None
    if static >= memory:
        return 0
    return max(0, int((memory - static) // per_sample)) if per_sample > 0 else None


def host_models(spec: ClusterSpec, profile: Profile, opts: PlanOptions) -> list[HostModel]:
    hosts = inputs.replicate_hosts(spec, len(spec.hosts))  # the spec's hosts, group by group (ring order)
    threads = opts.threads or profile.threads
    cores = inputs.host_cores(hosts, threads=threads, colocated_cores=opts.colocated_cores)
    speeds = inputs.host_speeds(cores, profile_threads=profile.threads, threads=threads, profile=profile,
                                colocated_cores=opts.colocated_cores)  # co-located: the measured co-run factor too
    p, act = len(hosts), profile.activation_bytes_per_sample
    dense, comp = static_bytes(profile, opts, compressed=False, p=p), static_bytes(profile, opts, compressed=True, p=p)
    return [HostModel(name=h.name, group=h.group, speed=s, cores=c, bandwidth=h.bandwidth,
                      cap_dense=micro_cap(h.memory, dense, act), cap_comp=micro_cap(h.memory, comp, act),
                      nic_cpu=h.nic.cpu if h.nic is not None else None)
            for h, s, c in zip(hosts, speeds, cores)]


def codec_models(profile: Profile, codecs: tuple[str, ...], max_error: float = MAX_EF_ERROR,
                 rank: str = "time") -> tuple[dict, dict[str, float], list[str]]:
    """Codec models priced with the profile's measured costs, their sample factors, and notes.

    Codecs the profile did not measure are dropped (with a note), unless it measured none at all
    (then bytes only). The guard:

    * ``rank="time"`` with the profile's convergence guard (:mod:`thinwire.measure.convergence`): each
      codec's sample factor is what the search multiplies its step by; a codec the guard says does not
      reach fp32's loss (more than ``REACH_TOL`` above it at equal samples), could not price (worse than
      fp32 after its first steps) or did not run is left out, whatever time it would save: a gap beyond
      the tolerance after a short run may shrink or grow over a full one (``guard_eval.md``: PowerSGD on
      charlm, +2.4% after 60 steps, +11% after 480), so its factor is no prediction. ``auto`` never tries
      such a codec either (one guard). This replaces the relative-error cap.
    * ``rank="step"``, or a profile without the guard: every factor is 1 and the accuracy cap applies:
      a codec whose relative error with error feedback on this workload's gradients (``ef_error``)
      is above ``max_error`` is left out (top-k 1% and PowerSGD rank 4 on charlm: above 0.9, and neither
      reached fp32's loss at equal samples in the head-to-head)."""
    from thinwire.compress.spec import parse_codec_spec, spec_string

    measured = bool(profile.codecs)
    guarded = rank == "time" and profile.guarded
    out, factors, notes = {}, {}, []
    for c in codecs:
        name = spec_string(parse_codec_spec(c))
        if measured and name != "none" and name not in profile.codecs:
            notes.append(f"codec {name} left out: the profile has no measured cost for it "
                         f"(add it with `thinwire profile --codecs {name}`)")
            continue
        if guarded and name != "none":
            record = profile.codecs[name].convergence
            if record is None or record.factor is None:
                why = ("the profile's convergence guard did not run it" if record is None else
                       f"after {record.steps} steps its held-out loss ({record.loss:.4g}) was still above fp32's first "
                       f"evaluation: its sample factor is unknown")
                notes.append(f"codec {name} left out: {why} (--rank step ranks it by step time)")
                continue
            if not record.reaches:
                notes.append(f"codec {name} left out: the convergence guard says it does not reach fp32's loss "
                             f"({record.gap_text()} over the second half of {record.steps} steps, tolerance "
                             f"{REACH_TOL:.0%}); its gap need not stay constant, so its time to the target is not "
                             f"predicted (as `auto` never tries it; --rank step ranks it by step time)")
                continue
            factors[name] = record.factor
        error = profile.codecs[name].ef_error if measured and name in profile.codecs else None
        if not guarded and error is not None and error > max_error:
            notes.append(f"codec {name} left out by the accuracy guard: with error feedback it leaves {error:.0%} of "
                         f"each step's gradient behind on this workload (cap {max_error:.0%}, --max-error)")
            continue
        out[name] = inputs.codec_model(name, profile if measured else None)
    if not measured:
        notes.append("the profile has no measured codec costs: codecs are priced by their bytes only")
    if rank == "time" and not guarded:
        notes.append("the profile has no convergence guard (made with --guard-steps 0 or by an older thinwire): "
                     "candidates are ranked by step time, as with --rank step; `thinwire profile` measures it")
    return out, factors, notes


def validation_items(profile: Profile, opts: PlanOptions) -> tuple[int, str | None]:
    """(items one validation forwards, a note or None), as ``workloads.base.eval_subset`` picks them: the
    profile's validation set size (``val_items``) capped at ``eval_batches`` global batches. None with
    ``--rank step``, which ranks by step time alone."""
    if opts.eval_every == 0 or opts.rank == "step":
        return 0, None
    if opts.eval_batches == 0 and not profile.val_items:
        return 0, ("validation is not priced: the whole validation set was asked for (--eval-batches 0) and the "
                   "profile does not record its size (an older `thinwire profile` made it; profile again)")
    if not profile.val_items:
        return opts.eval_batches * opts.batch_size, None
    from thinwire.workloads.base import eval_subset

    return len(eval_subset(profile.val_items, opts.eval_batches, opts.batch_size)), None


def problem(spec: ClusterSpec, profile: Profile, opts: PlanOptions, hosts: list[HostModel]) -> tuple[Problem, list[str]]:
    codecs, factors, notes = codec_models(profile, opts.codecs, opts.max_error, opts.rank)
    val_items, note = validation_items(profile, opts)
    notes += [note] if note else []
    alpha = profile.network.alpha_s if profile.network else DEFAULT_ALPHA_S
    pb = Problem(hosts=hosts, buckets=[Bucket(numel=b.numel, ready_frac=b.ready_frac) for b in profile.buckets],
                 compute=compute_fn(profile, opts), codecs=codecs,
                 links={l.pair: l.bandwidth for l in spec.links}, alpha_s=alpha,
                 efficiency=inputs.efficiency_of(profile), batch=opts.batch_size,
                 threads=opts.threads or profile.threads, min_gain=opts.min_gain, factors=factors,
                 cpu_s_per_byte=profile.collective_cpu_s_per_byte,
                 busy_hop_s=(profile.network.busy_hop_s or 0.0) if profile.network else 0.0,
                 val_items=val_items, eval_every=max(1, opts.eval_every),
                 latencies={l.pair: l.latency for l in spec.links if l.latency})
    if spec.switch is not None:  # int8 (nearest rounding) may go through the aggregator on the switch
        from thinwire.compress.schemes.switched import switchable

        net = inputs.ring_network(spec, spec.hosts, profile)
        pb.switch_speed, pb.switch_cpu, pb.switch_trainer_cpu = net.switch_speed, net.switch_cpu, net.switch_trainer_cpu
        pb.switch_codecs = {name: inputs.codec_model(name, profile if profile.codecs else None, switch=True)
                            for name in codecs if switchable(name)}
        if pb.switch_codecs and profile.aggregator is None and spec.switch.cpu is not None:
            notes.append(f"the switch's aggregator ({spec.switch.cpu:g} core) is priced from the transport's per-byte "
                         "CPU and the codec's kernels, which came to a third of its measured CPU on charlm: this profile "
                         "did not measure it (`thinwire profile --cluster SPEC` does, for a spec with `switch:`)")
    return pb, notes



def fits_nowhere(spec: ClusterSpec, profile: Profile, opts: PlanOptions, workload: str) -> ThinwireError:
    need = static_bytes(profile, opts, compressed=False, p=len(spec.hosts)) + profile.activation_bytes_per_sample
    largest = max(spec.hosts, key=lambda h: h.memory or 0)
    total = sum(h.memory or 0 for h in spec.hosts)
    if profile.layers:
        from thinwire.plan.pipeline import smallest_stage_memory

        least = smallest_stage_memory(profile, min(len(spec.hosts), len(profile.layers)), batch=opts.batch_size)
        pipe = (f"no pipeline over the {len(spec.hosts)} hosts fits either: its smallest split still needs "
                f"{least / 2**20:.1f} MiB on some host (the smallest per-host memory that would fit)")
    else:
        pipe = (f"and {workload} has no layer list to pipeline over the {len(spec.hosts)} hosts "
                f"({total / 2**20:.1f} MiB in total)")
    runtime = profile.runtime_bytes
    parts = (f"the worker process itself {runtime / 2**20:.1f} MiB (Python, torch), then " if runtime else "") + \
        f"parameters, gradients, {opts.optimizer} state, DDP buckets, activations"
    # where the process alone does not fit, a smaller model cannot help
    fix = ("Give the hosts more memory (hosts[].memory): at least " f"{need / 2**20:.0f} MiB" if runtime >= largest.memory
           else "Give the hosts more memory (hosts[].memory) or plan a smaller model (--set model.width=...)")
    return ThinwireError(
        f"model: {workload} with {profile.parameters:,} parameters fits nowhere: training it with one sample needs "
        f"{need / 2**20:.1f} MiB on a host ({parts}), the largest host {largest.name} has "
        f"{largest.memory / 2**20:.1f} MiB, {pipe}. {fix}.")


# -- assembling the plan --------------------------------------------------------------------------------
def decision(pb: Problem, s: Scored, left_out: list[str]) -> Decision:
    lay = s.layout
    names = [pb.hosts[i].name for i in lay.hosts]
    out = left_out + [h.name for i, h in enumerate(pb.hosts) if i not in lay.hosts]
    groups = [[pb.hosts[i].name for i in g] for g in lay.groups] if lay.groups else []
    return Decision(name=explain.name(pb, s), hosts=names, shares=list(lay.shares), micro=list(lay.micro),
                    collective="hierarchical" if lay.groups else "switch" if lay.switch else "ring", groups=groups,
                    codecs=list(lay.codecs),
                    left_out=out, predicted_step_s=s.step_s, compute_s=s.compute_s,
                    exposed_comm_s=s.timeline.exposed_comm_s, bytes_per_step=s.bytes_per_step, sample_factor=s.factor,
                    validation_s=s.val_s)


def make_plan(spec: ClusterSpec, profile: Profile, *, workload: str, model: dict, options: PlanOptions) -> Plan:
    """Plan ``workload`` on ``spec`` for ``options.batch_size`` (see the module docstring)."""
    t0 = time.perf_counter()
    check_profile(profile, workload, model)
    all_hosts = host_models(spec, profile, options)
    fit = [h for h in all_hosts if h.cap_dense is None or h.cap_dense >= 1]
    head = dict(cluster=spec.name, cluster_fingerprint=cluster_fingerprint(spec), cluster_hosts=host_summary(spec),
                workload=workload, model=normalized_model(workload, model),
                workload_fingerprint=workload_fingerprint(workload, model), parameters=profile.parameters,
                global_batch=options.batch_size, bucket_mb=profile.bucket_mb,
                bucket_numels=[b.numel for b in profile.buckets], threads=options.threads or profile.threads)
    if not fit or options.pipeline:
        return _pipeline_plan(spec, profile, options, workload, all_hosts, head, t0, fits_one=bool(fit))
    pb, notes = problem(spec, profile, options, fit)
    ranked = search(pb, keep=options.keep + 1)
    base = {c: uniform(pb, c) for c in pb.codecs}
    left = [h.name for h in all_hosts if h not in fit]
    chosen = decision(pb, ranked[0], left)
    alts = [decision(pb, s, left) for s in ranked[1:]]
    lines = explain.explain(pb, ranked[0], base, all_hosts, notes) + explain.sync_lines(pb, base, profile.sync)
    baselines = {}
    if base["none"] is not None:  # None: fewer samples than hosts, uniform DDP cannot run
        best_single = min((s for s in base.values() if s is not None), key=lambda s: s.step_s)
        baselines = {"uniform_ddp_fp32_s": base["none"].step_s, "best_single_codec": best_single.layout.codecs[0],
                     "best_single_codec_s": best_single.step_s,
                     # its time per step to fp32's loss as the ranking counts it (its validation included)
                     "uniform_ddp_fp32_time_s": base["none"].time_s}
    planning = {"seconds": time.perf_counter() - t0, "candidates_scored": pb.scored, "hosts": len(spec.hosts),
                "validation": {"every": options.eval_every, "batches": options.eval_batches, "items": pb.val_items}}
    return Plan(**head, chosen=chosen, alternatives=alts, baselines=baselines, explanation=lines, planning=planning)


def _pipeline_plan(spec, profile, options, workload, all_hosts, head, t0, *, fits_one: bool) -> Plan:
    """A pipeline over all hosts (:mod:`thinwire.plan.pipeline`), with uniform DDP fp32's prediction beside it
    when data parallelism fits."""
    from thinwire.plan.pipeline import plan_pipeline

    if not profile.layers:
        if fits_one:
            raise ThinwireError(f"plan: --pipeline needs the per-layer costs of {workload}'s layer list; this profile "
                                "has none: the workload has no layer list (a Workload's layers=, or an nn.Sequential "
                                "model), or the profile was made before it had one. Profile it again with "
                                "`thinwire profile` once it has one.")
        raise fits_nowhere(spec, profile, options, workload)
    pipe = plan_pipeline(spec, profile, batch=options.batch_size, threads=options.threads or profile.threads,
                         colocated_cores=options.colocated_cores)
    if pipe is None and fits_one:  # data parallelism fits (where memory allows): say so, not "fits nowhere"
        from thinwire.plan.pipeline import smallest_stage_memory

        least = smallest_stage_memory(profile, min(len(spec.hosts), len(profile.layers)), batch=options.batch_size)
        small = [h.name for h in spec.hosts if h.memory is not None and h.memory < least]
        raise ThinwireError(
            f"plan: --pipeline: no pipeline over all {len(spec.hosts)} hosts fits: a stage of its smallest split "
            f"still needs {least / 2**20:.1f} MiB, more than {', '.join(small) or 'some host'} "
            f"{'have' if len(small) > 1 else 'has'}. Data parallelism fits where memory allows: plan without "
            "--pipeline (hosts that cannot hold the model are left out), or give those hosts more memory "
            "(hosts[].memory).")
    if pipe is None:
        raise fits_nowhere(spec, profile, options, workload)
    baselines = {}
    if fits_one:
        pb, _ = problem(spec, profile, options, [h for h in all_hosts if h.cap_dense is None or h.cap_dense >= 1])
        ddp = uniform(pb, "none")
        if ddp is not None:
            baselines = {"uniform_ddp_fp32_s": ddp.step_s}
    lines = explain.pipeline_lines(pipe, profile, baselines.get("uniform_ddp_fp32_s"), fits_one)
    planning = {"seconds": time.perf_counter() - t0, "candidates_scored": 0, "hosts": len(spec.hosts)}
    return Plan(**head, executable=True, pipeline=pipe, baselines=baselines, explanation=lines, planning=planning)
