"""The planner's pipeline: the layer list cut over the cluster's hosts by their measured speed and memory,
the activation format of each link, the micro-batch count, and the predicted step.

Steps of :func:`plan_pipeline`:

1. **Hosts** in the spec's order, one stage each (the fastest ones, in order, if there are more hosts
   than layers); speeds as the simulator has them (:func:`thinwire.sim.pipeline.stage_speeds`). The
   search runs again without the slowest hosts (:func:`_host_sets`) and keeps the fastest pipeline: a
   host at a hundredth of the others' speed paced every micro-batch holding only the head.
2. **Micro-batches and memory**: from the largest divisor of the batch up to 4 x stages (GPipe's rule)
   upward through the batch's larger divisors (smaller micro-batches hold less), each with and without
   recomputing activations in backward (activation checkpointing: one more forward, only each layer's
   input held); the fastest that fits. 1F1B (the same bubble as GPipe, fewer activations held) unless
   there are fewer micro-batches than stages.
3. **Split**: for each link format (fp32, bf16, int8 on every link) the contiguous split minimizing the
   slowest stage or link (:func:`thinwire.perf.pipeline.split_for_speeds`), each stage within its host's
   memory (:func:`stage_memory`); each priced by :func:`thinwire.sim.pipeline.predict_pipeline`.
4. **Links**: the most precise uniform format within 5% of the fastest, then each link put back to
   fp32 (or bf16) where that costs at most 2% of the step: compression only on the links that pace
   the pipeline (its loss effect is measured in ``benchmarks/results/pipeline.md``).
5. **Interleaved where it pays**: the same search with each host holding 2 stages (``ScheduleInterleaved1F1B``,
   the layer list cut in 2 S, stage k on host ``k % S``, each host's stages within its memory with the
   micro-batches torch's order keeps in flight), taken only if predicted at least 3% faster than the best
   1F1B or GPipe plan: its bubble is half 1F1B's, for twice the hand-overs and its runtime's own cost per
   micro-batch (``profile``'s ``interleaved_overhead_s``; a profile without it is not offered interleaved
   plans; on this project's CPU hosts it did not pay,
   ``benchmarks/results/pipeline_interleaved.md``).
6. **Why**: the same hosts with the split balanced by parameters (what ``--pipeline 1f1b`` does without
   ``layers=``) are priced too, so the explanation says what the uneven split buys.
"""

from __future__ import annotations

from thinwire.cluster.spec import ClusterSpec, HostSpec
from thinwire.measure.file import Profile
from thinwire.perf.pipeline import split_for_speeds
from thinwire.pipeline.layout import default_microbatches
from thinwire.pipeline.stages import balanced_split
from thinwire.plan.planfile import PipelinePlan, Stage
from thinwire.sim.pipeline import needs_layers, predict_pipeline, stage_speeds

FORMATS = ("fp32", "bf16", "int8")  # most precise first
UNIFORM_SLACK, LINK_SLACK = 1.05, 1.02
INTERLEAVED_GAIN = 0.97             # interleaved only where predicted at least 3% faster
VIRTUAL = 2                         # stages per host the planner tries interleaved with
STATE_BYTES = 16                    # fp32 weights, gradients and AdamW's two moments per parameter


def stage_memory(profile: Profile, run: list[int], *, micro: int, inflight: int, recompute: bool = False) -> int:
    """Bytes a stage's process holds at its peak: the process itself (``runtime_bytes``), then the larger of
    the whole model's weights (every rank builds the model from the seed before keeping its stage) and its
    stage's training state with the activations of ``inflight`` micro-batches (1F1B: at most the stages
    after it; GPipe: all of them) and its input and output buffers. With ``recompute`` a micro-batch in
    flight holds only each layer's input, plus one layer's activations while it is recomputed."""
    return host_memory(profile, [(run, inflight)], micro=micro, recompute=recompute)


def host_memory(profile: Profile, parts: list[tuple[list[int], int]], *, micro: int, recompute: bool = False) -> int:
    """:func:`stage_memory` of a host holding several stages (interleaved): ``(run, inflight)`` each, their
    training states together beside the process and the whole model's weights."""
    whole = sum(l.parameters for l in profile.layers) * 4
    return int(profile.runtime_bytes + max(whole, sum(
        _state_bytes(profile, run, micro=micro, inflight=inflight, recompute=recompute) for run, inflight in parts)))


def _state_bytes(profile: Profile, run: list[int], *, micro: int, inflight: int, recompute: bool = False) -> float:
    layers = [profile.layers[i] for i in run]
    params = sum(l.parameters for l in layers)
    if recompute:
        inputs = sum(profile.layers[i - 1].output_bytes if i > 0 else 0.0 for i in run)
        acts = inputs * micro * inflight + max(l.saved_bytes for l in layers) * micro
    else:
        acts = sum(l.saved_bytes for l in layers) * micro * inflight
    buffers = 2 * (layers[-1].output_bytes + profile.layers[max(0, run[0] - 1)].output_bytes) * micro * inflight
    return params * STATE_BYTES + acts + buffers


def smallest_stage_memory(profile: Profile, stages: int, *, batch: int) -> int:
    """The least memory every host needs for some split into ``stages``: the split minimizing the largest
    stage's memory, at the most micro-batches (the smallest) with activations recomputed (1F1B, the first
    stage holding ``stages`` micro-batches' inputs)."""
    micro_n = batch
    micro, inflight = 1, min(micro_n, stages)
    per_layer = [_state_bytes(profile, [i], micro=micro, inflight=inflight, recompute=True)
                 for i in range(len(profile.layers))]
    runs = balanced_split(per_layer, stages)
    return max(stage_memory(profile, run, micro=micro, inflight=inflight, recompute=True) for run in runs)


def microbatch_counts(batch: int, stages: int) -> list[int]:
    """Candidate micro-batch counts, fewest first: every divisor of the batch from one micro-batch per stage
    (fewer leave stages idle in every schedule) up, through GPipe's default (:func:`default_microbatches`) to
    the batch itself (smaller micro-batches hold less memory). Fewer than the default pay where a
    micro-batch's fixed cost (its hand-offs, a slow host's per-call overhead) outweighs the bubble: a small
    model's 16 micro-batches of 2 samples ran at the pace of that overhead on every stage."""
    first = min(stages, default_microbatches(batch, stages))
    return [m for m in range(first, batch + 1) if batch % m == 0]


def plan_pipeline(spec: ClusterSpec, profile: Profile, *, batch: int, threads: int = 1,
                  colocated_cores: float | None = None) -> PipelinePlan | None:
    """The fastest predicted pipeline over the spec's hosts (module docstring); None if no split fits memory."""
    needs_layers(profile)
    every = list(spec.hosts)
    speeds = stage_speeds(profile, every, threads=threads, colocated_cores=colocated_cores, cluster=spec.name)
    best, with_all = None, None
    for i, sub in enumerate(_host_sets(every, speeds, len(profile.layers))):
        got = _over(spec, profile, sub, batch=batch, threads=threads, colocated_cores=colocated_cores)
        if i == 0:
            with_all = got
        if got is not None and (best is None or got.predicted_step_s < best.predicted_step_s * 0.999):
            best = got
    if best is not None and best is not with_all:
        best.left_out = [h.name for h in every if h.name not in best.hosts]
        best.with_all_hosts_step_s = with_all.predicted_step_s if with_all is not None else None
    return best


def _host_sets(hosts: list[HostSpec], speeds: list[float], layers: int) -> list[list[HostSpec]]:
    """The hosts to pipeline over, in the spec's order: all of them (the fastest ``layers`` if there are more
    hosts than layers), then without the slowest (each of up to 8 of the hosts' own speeds as a threshold, at
    least 2 hosts left): a host slow enough paces the pipeline more than its share of the layers saves."""
    def fastest(idx):
        return [hosts[i] for i in sorted(sorted(idx, key=lambda i: -speeds[i])[:layers])]

    out = [fastest(range(len(hosts)))]
    for t in sorted(set(speeds), reverse=True)[:-1][-8:]:
        sub = fastest([i for i in range(len(hosts)) if speeds[i] >= t])
        if len(sub) >= 2 and sub not in out:
            out.append(sub)
    return out


def _over(spec: ClusterSpec, profile: Profile, hosts: list[HostSpec], *, batch: int, threads: int,
          colocated_cores: float | None) -> PipelinePlan | None:
    """The fastest predicted pipeline over ``hosts``, one stage each (or two, interleaved); None if none fits."""
    n = len(profile.layers)
    S = len(hosts)
    speeds = stage_speeds(profile, hosts, threads=threads, colocated_cores=colocated_cores, cluster=spec.name)
    found = {}
    # interleaved only where its runtime's own cost is measured (a profile before it cannot price it)
    priced = profile.interleaved_overhead_s is not None
    for virtual in (1, VIRTUAL) if n >= VIRTUAL * S and priced and S >= 2 else (1,):  # one host: no bubble to fill
        best = None
        for micro_n in microbatch_counts(batch, S):
            if virtual > 1 and micro_n % max(1, micro_n // S):
                continue  # torch's interleaved schedule runs micro-batches in whole rounds
            for recompute in (False, True):  # recomputation only where nothing fits without it, or it is faster
                got = _best_for(spec, profile, hosts, speeds, batch, micro_n, recompute, threads, colocated_cores,
                                virtual)
                if got is not None and (best is None or got[0].step_s < best[0].step_s * 0.999):
                    best = got
            if best is not None and micro_n >= 4 * S:
                break  # the bubble is already negligible; more, smaller micro-batches only add overhead
        if best is not None:
            found[virtual] = best
    if not found:
        return None
    steps = {found[v][6]: found[v][0].step_s for v in found}
    pick = VIRTUAL if VIRTUAL in found and (1 not in found or steps["interleaved"] < found[1][0].step_s
                                            * INTERLEAVED_GAIN) else 1
    pred, runs, links, price, micro_n, recompute, schedule = found[pick]
    micro = batch // micro_n
    even = balanced_split([float(l.parameters) for l in profile.layers], len(runs))
    even_pred = predict_pipeline(**price, runs=even, activations=links)
    inflight = _inflight(schedule, S, len(runs) // S, micro_n)
    stages = [Stage(host=hosts[k % S].name, first_layer=run[0], last_layer=run[-1],
                    layers=[profile.layers[i].name for i in run],
                    parameters=sum(profile.layers[i].parameters for i in run),
                    memory_bytes=stage_memory(profile, run, micro=micro, recompute=recompute, inflight=inflight[k]),
                    seconds_per_microbatch=pred.stage_s[k]) for k, run in enumerate(runs)]
    return PipelinePlan(stages=stages, schedule=schedule, microbatches=micro_n, links=links, recompute=recompute,
                        predicted_step_s=pred.step_s, even_split_step_s=even_pred.step_s,
                        even_split=[len(r) for r in even], bottleneck=pred.bottleneck, note="",
                        virtual=len(runs) // S, alternative_step_s={k: v for k, v in steps.items() if k != schedule})


def _inflight(schedule: str, S: int, V: int, M: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once in the schedule's order: 1F1B
    ``min(M, S - s)``, GPipe all M, interleaved as torch orders it
    (:func:`thinwire.pipeline.programs.interleaved_programs`)."""
    if schedule == "gpipe":
        return [M] * S
    if schedule == "1f1b":
        return [min(M, S - s) for s in range(S)]
    from thinwire.pipeline.programs import interleaved_programs

    most = [0] * (S * V)
    for prog in interleaved_programs(S, V, M):
        live = [0] * (S * V)
        for what, arg in prog:
            if what in ("F", "B"):
                live[arg[0]] += 1 if what == "F" else -1
                most[arg[0]] = max(most[arg[0]], live[arg[0]])
    return most


def _best_for(spec, profile, hosts, speeds, batch, micro_n, recompute, threads, colocated_cores, virtual=1):
    """The split and link formats for one micro-batch count and recomputation choice (``virtual`` stages per
    host: interleaved), or None if none fits."""
    S = len(hosts)
    schedule = "interleaved" if virtual > 1 else "1f1b" if micro_n >= S else "gpipe"
    micro = batch // micro_n
    price = dict(spec=spec, profile=profile, hosts=hosts, microbatches=micro_n, replica_batch=batch, threads=threads,
                 colocated_cores=colocated_cores, recompute=recompute, schedule=schedule)
    inflight = _inflight(schedule, S, virtual, micro_n)

    def fits(s: int, first: int, last: int) -> bool:
        mem = hosts[s].memory
        return mem is None or stage_memory(profile, list(range(first, last + 1)), micro=micro, inflight=inflight[s],
                                           recompute=recompute) <= mem

    def host_fits(runs) -> bool:  # interleaved: a host holds its stages' state together
        return all(host.memory is None or host_memory(
            profile, [(run, inflight[k]) for k, run in enumerate(runs) if k % S == h], micro=micro,
            recompute=recompute) <= host.memory for h, host in enumerate(hosts))

    candidates = []
    for fmt in FORMATS:
        if virtual > 1:
            runs = _split(profile, [speeds[k % S] for k in range(S * virtual)], fmt, micro, hosts, None, recompute)
            runs = runs if runs is not None and host_fits(runs) else None
        else:
            runs = _split(profile, speeds, fmt, micro, hosts, fits, recompute)
        if runs is not None:
            candidates.append((predict_pipeline(**price, runs=runs, activations=[fmt] * (len(runs) - 1)).step_s, fmt,
                               runs))
    if not candidates:
        return None
    fastest = min(c[0] for c in candidates)
    step, fmt, runs = next(c for c in candidates if c[0] <= fastest * UNIFORM_SLACK)  # most precise that is close
    links = _relax_links(price, runs, [fmt] * (len(runs) - 1), step)
    return predict_pipeline(**price, runs=runs, activations=links), runs, links, price, micro_n, recompute, schedule


def _split(profile: Profile, speeds: list[float], fmt: str, micro: int, hosts: list[HostSpec], fits,
           recompute: bool = False):
    """The split for one uniform link format: layer seconds per micro-batch (one more forward when
    recomputed); a cut after layer k costs its output and gradient on the slower host's egress."""
    from thinwire.pipeline.wire import payload_bytes

    lb = profile.layers_batch
    layer_s = [l.forward_call_s(micro, lb) * (2 if recompute else 1) + l.backward_call_s(micro, lb)
               for l in profile.layers]
    slowest = min(h.bandwidth for h in hosts) / 8
    link_s = [2 * payload_bytes(fmt, int(l.output_bytes * micro / 4), l.width) / slowest for l in profile.layers]
    return split_for_speeds(layer_s, speeds, link_s=link_s, fits=fits)


def _relax_links(price: dict, runs, links: list[str], step: float) -> list[str]:
    """Each compressed link back to the most precise format that costs at most ``LINK_SLACK`` of the step."""
    links = list(links)
    for k, fmt in enumerate(links):
        for better in FORMATS[:FORMATS.index(fmt)]:
            trial = links[:k] + [better] + links[k + 1:]
            if predict_pipeline(**price, runs=runs, activations=trial).step_s <= step * LINK_SLACK:
                links = trial
                break
    return links
