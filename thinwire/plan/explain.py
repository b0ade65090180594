"""Plain-words explanation of a plan: the bottleneck, and what each decision buys.

Each decision is priced by taking it back with the others kept (an ablation through the same
performance model): even shares instead of uneven ones, every host kept instead of leaving one
out, a flat ring instead of the hierarchical collective, fp32 instead of the chosen codecs. The
difference in predicted step time is what the decision buys.
"""

from __future__ import annotations

import dataclasses

from thinwire.perf import collectives as coll
from thinwire.plan.search import HostModel, Layout, Problem, Scored, allocate, caps_for, even, micro_for, score


def _even(shares) -> bool:
    return max(shares) - min(shares) <= 1


def _listing(items: list[str], most: int = 8) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def codec_words(codecs: tuple[str, ...] | list[str]) -> str:
    if len(set(codecs)) == 1:
        return codecs[0]
    return ", ".join(f"{c} on bucket {i}" for i, c in enumerate(codecs))


def name(pb: Problem, s: Scored) -> str:
    """A short name: hosts, shares, collective, codecs."""
    lay = s.layout
    left = [h.name for i, h in enumerate(pb.hosts) if i not in lay.hosts]
    hosts = f"{len(lay.hosts)} host{'s' * (len(lay.hosts) != 1)}" + (f" without {_listing(left, 4)}" if left else "")
    if len(lay.hosts) == 1:
        return f"{hosts}, no communication"
    shares = "even shares" if _even(lay.shares) else "uneven shares"
    if lay.groups:
        groups = " | ".join(",".join(pb.hosts[i].name for i in g) for g in lay.groups)
        coll_ = f"hierarchical [{groups}]"
    else:
        coll_ = "int8 through the switch's aggregator" if lay.switch else "ring"
    prefix = "uniform DDP, " if lay.uniform else ""
    return f"{prefix}{hosts}, {shares}, {coll_}, {codec_words(lay.codecs)}"


def ring_bottleneck(pb: Problem, idx: tuple[int, ...]) -> str:
    """The slowest edge of the ring over ``idx``, in words."""
    hs = [pb.hosts[i] for i in idx]
    rates = coll.ring_edge_rates([h.bandwidth for h in hs], [h.group for h in hs], pb.links)
    k = min(range(len(rates)), key=rates.__getitem__)
    a, b = hs[k], hs[(k + 1) % len(hs)]
    # the edge's rate is the lesser of its two access links and, across groups, its share of the link between
    where = f"the {a.group}-{b.group} link" if rates[k] < min(a.bandwidth, b.bandwidth) \
        else f"the access link of {a.name if a.bandwidth <= b.bandwidth else b.name}"
    return f"{where} at {rates[k] / 1e6:g} Mbit/s ({a.name} -> {b.name})"


def bottleneck(pb: Problem, s: Scored) -> str:
    """Which resource sets the pace of ``s``: the slowest host's compute, or the network."""
    lay = s.layout
    times = {pb.hosts[h].name: pb.host_compute(b, m).total_s / pb.hosts[h].speed
             for h, b, m in zip(lay.hosts, lay.shares, lay.micro)}
    slow, fast = max(times, key=times.get), min(times, key=times.get)
    wait = times[slow] - times[fast]
    exposed = s.timeline.exposed_comm_s
    if exposed <= 0.05 * s.step_s and wait <= 0.05 * s.step_s:
        return f"compute, balanced: every host computes for about {_ms(times[slow])}"
    if wait >= exposed:
        h = next(x for x in pb.hosts if x.name == slow)
        return (f"compute on {slow} (speed {h.speed:g}): it computes for {_ms(times[slow])} while "
                f"{fast} is done after {_ms(times[fast])} and waits")
    if lay.switch:  # each host's own link to the switch carries its payload up and the sum down
        h = min((pb.hosts[i] for i in lay.hosts), key=lambda x: x.bandwidth)
        return (f"the network: {_ms(exposed)} of communication is not hidden behind backward; the slowest link "
                f"to the switch is {h.name}'s at {h.bandwidth / 1e6:g} Mbit/s")
    ring = tuple(g[0] for g in lay.groups) if lay.groups else lay.hosts
    return (f"the network: {_ms(exposed)} of communication is not hidden behind backward; "
            f"the slowest edge{' between leaders' if lay.groups else ''} is {ring_bottleneck(pb, ring)}")


def _ablation(pb: Problem, chosen: Scored, **change) -> Scored:
    return score(pb, dataclasses.replace(chosen.layout, **change))


def _shares_line(pb: Problem, c: Scored) -> str | None:
    lay = c.layout
    if _even(lay.shares):
        return None
    caps, _ = caps_for(pb, lay.hosts, lay.groups)
    shares = even(pb.batch, len(lay.hosts))
    alt = _ablation(pb, c, shares=shares, micro=tuple(micro_for(k, s) for k, s in zip(caps, shares)))
    per = _listing([f"{pb.hosts[h].name} {b}" for h, b in zip(lay.hosts, lay.shares)], 12)
    return (f"Uneven batch shares ({per}; about proportional to speed, so no host waits for a slower one) "
            f"instead of even ones: saves {_ms(alt.step_s - c.step_s)} per step ({_ms(alt.step_s)} -> "
            f"{_ms(c.step_s)}). Losses are weighted by share x world / batch, so the update equals the uniform one.")


def _left_out_line(pb: Problem, c: Scored) -> str | None:
    lay = c.layout
    out = [i for i in range(len(pb.hosts)) if i not in lay.hosts]
    if not out:
        return None
    everyone = tuple(range(len(pb.hosts)))
    caps, ok = caps_for(pb, everyone, None)
    got = allocate(pb, everyone, caps)
    reasons = _listing([f"{pb.hosts[i].name} (speed {pb.hosts[i].speed:g}, {pb.hosts[i].bandwidth / 1e6:g} Mbit/s)"
                        for i in out])
    if got is None:
        return f"Leaving out {reasons}: the global batch is smaller than the number of hosts."
    codecs = lay.codecs if ok else ("none",) * len(lay.codecs)
    alt = score(pb, Layout(everyone, got[0], tuple(micro_for(k, s) for k, s in zip(caps, got[0])), None, codecs))
    them = "it" if len(out) == 1 else "them"
    keeping = f"keeping {them} (balanced shares, a flat ring, the same codecs)"
    if alt.step_s > c.step_s:
        kept = [pb.hosts[i] for i in lay.hosts]
        why = []  # each one's own cost, against the hosts kept: its compute, its link, or only more hosts in the ring
        for i in out:
            h, slow = pb.hosts[i], []
            if h.speed < min(k.speed for k in kept):
                slow.append("its compute")
            if h.bandwidth < min(k.bandwidth for k in kept):
                slow.append("its link")
            why.append(f"{h.name}: {' and '.join(slow)}" if slow else f"{h.name}: one more host in the ring, no "
                       "slower than those kept")
        return (f"Leaving out {reasons}: {keeping} is predicted at {_ms(alt.step_s)} per step, "
                f"{_ms(alt.step_s - c.step_s)} slower ({'; '.join(why)}).")
    # its steps are not slower: what it costs is elsewhere (its share of each validation, a codec's samples)
    where = ("its share of each validation, split over the hosts by their shares of the batch"
             if alt.val_per_step_s > c.val_per_step_s else "the samples its codecs need")
    return (f"Leaving out {reasons}: {keeping} steps in {_ms(alt.step_s)}, {_ms(c.step_s - alt.step_s)} faster, but "
            f"costs more in {where}: {_ms(alt.time_s)} against {_ms(c.time_s)} per fp32-equivalent step, "
            "validation included.")


def _grouping_line(pb: Problem, c: Scored) -> str | None:
    lay = c.layout
    if not lay.groups:
        return None
    alt = _ablation(pb, c, groups=None)
    leaders = ", ".join(pb.hosts[g[0]].name for g in lay.groups)
    return (f"Hierarchical all-reduce (dense fp32 inside each group, the codec only between the leaders {leaders}) "
            f"instead of one ring through the slow link: saves {_ms(alt.step_s - c.step_s)} per step "
            f"({_ms(alt.step_s)} -> {_ms(c.step_s)}).")


def _codec_line(pb: Problem, c: Scored) -> str | None:
    lay = c.layout
    if set(lay.codecs) == {"none"}:
        if len(lay.hosts) == 1:
            return "No compression: one host sends nothing."
        if set(pb.codecs) <= {"none"}:  # every other candidate was left out before pricing
            return "No compression: no codec of --codecs was left to price (the notes say why each was left out)."
        return "No compression: the codecs' own cost would exceed what they save on the wire."
    alt = _ablation(pb, c, codecs=("none",) * len(lay.codecs))
    where = "between group leaders" if lay.groups else "through the switch's aggregator" if lay.switch else "on the ring"
    return (f"Codec {codec_words(lay.codecs)} {where}: {alt.codec_bytes / 1e6:.2f} -> {c.codec_bytes / 1e6:.2f} MB "
            f"sent per step by {'each leader' if lay.groups else 'each rank'}, saves {_ms(alt.step_s - c.step_s)} "
            f"per step ({_ms(alt.step_s)} -> {_ms(c.step_s)}) after paying its encode/decode time.")


def _micro_line(pb: Problem, c: Scored) -> str | None:
    lay = c.layout
    parts = [f"{pb.hosts[h].name} accumulates micro-batches of {m} (share {b})"
             for h, b, m in zip(lay.hosts, lay.shares, lay.micro) if m < b]
    return ("To fit memory: " + _listing(parts) + ".") if parts else None


def explain(pb: Problem, chosen: Scored, base: dict[str, Scored | None], all_hosts: list[HostModel],
            notes: list[str]) -> list[str]:
    """The explanation's lines, in the order a reader needs them."""
    lines = []
    fp32 = base.get("none")
    if fp32 is not None:
        lines.append(f"Uniform DDP fp32 over {len(fp32.layout.hosts)} hosts is predicted at {_ms(fp32.step_s)} per step; "
                     f"its bottleneck is {bottleneck(pb, fp32)}.")
        singles = [s for s in base.values() if s is not None]
        best = min(singles, key=lambda s: s.step_s)
        lines.append(f"Chosen: {name(pb, chosen)}: {_ms(chosen.step_s)} per step, {fp32.step_s / chosen.step_s:.2f}x "
                     f"uniform DDP fp32 and {best.step_s / chosen.step_s:.2f}x uniform DDP with the best single codec "
                     f"({best.layout.codecs[0]}, {_ms(best.step_s)}).")
    else:
        lines.append(f"Uniform DDP cannot run: the global batch ({pb.batch}) is smaller than the {len(pb.hosts)} hosts. "
                     f"Chosen: {name(pb, chosen)}: {_ms(chosen.step_s)} per step.")
    lines.append(_ranking_line(pb, chosen, fp32))
    for h in all_hosts:
        if h not in pb.hosts:
            lines.append(f"{h.name} is left out: it cannot hold the model and one sample's activations in its memory.")
    for fn in (_left_out_line, _shares_line, _grouping_line, _codec_line, _micro_line):
        line = fn(pb, chosen)
        if line:
            lines.append(line)
    line = _validation_line(pb, chosen, fp32)
    if line:
        lines.append(line)
    lines.append(f"What remains: {bottleneck(pb, chosen)}.")
    return lines + [f"Note: {n}." for n in notes]


def _validation_line(pb: Problem, chosen: Scored, fp32: Scored | None) -> str | None:
    """What a validation costs on the chosen hosts, against uniform DDP's, and that it is counted."""
    if chosen.val_s <= 0:
        return None
    than = (f" (uniform DDP over {len(fp32.layout.hosts)} hosts: {_ms(fp32.val_s)})"
            if fp32 is not None and fp32.layout.hosts != chosen.layout.hosts else "")
    where = ("on its one host" if len(chosen.layout.hosts) == 1 else
             f"split over the {len(chosen.layout.hosts)} hosts by their shares of the batch")
    return (f"Validation: {pb.val_items} items every {pb.eval_every} steps, {where}, predicted at {_ms(chosen.val_s)} each{than}, "
            f"{_ms(chosen.val_per_step_s)} per step spread over the steps between validations; counted in the time to "
            "target (--eval-every 0 leaves it out).")


def _ranking_line(pb: Problem, chosen: Scored, fp32: Scored | None) -> str:
    """What the candidates were ranked by, and the chosen one's sample factor with where it came from."""
    if not pb.factors:
        return "Ranked by predicted step time (every codec counted as reaching DDP fp32's loss in as many samples)."
    factors = ", ".join(f"{c} {f:.2f}x" for c, f in sorted(pb.factors.items(), key=lambda kv: kv[1]))
    versus = (f"; predicted time to DDP fp32's loss {fp32.time_s / chosen.time_s:.2f}x sooner than uniform DDP fp32"
              if fp32 is not None else "")
    return (f"Ranked by predicted time to DDP fp32's loss: step time x the samples each codec needs relative to fp32, "
            f"measured by the profile's convergence guard (short runs of this workload from its initial weights, "
            f"extrapolated as a constant factor): {factors}. The chosen plan's factor is {chosen.factor:.2f}x{versus}.")


def sync_lines(pb: Problem, base: dict[str, Scored | None], guarded: dict | None = None) -> list[str]:
    """The sync modes' predicted steps on uniform DDP with the best single codec (the modes run on
    uniform DDP only, not with a plan's shares), each priced by the class that runs it; ``guarded``:
    mode -> the convergence guard's record (the profile's ``sync``), whose factor prices its samples."""
    from thinwire.compress.sync import StepParts, kind
    from thinwire.syncspec import SHOWN, parse_sync_spec

    singles = [s for s in base.values() if s is not None and len(s.layout.hosts) > 1]
    if not singles:
        return []
    best = min(singles, key=lambda s: s.time_s)
    spans = best.timeline.buckets
    # the compute with the slowest host's noise, as simulate and doctor price the modes
    parts = StepParts(allreduce_step_s=best.step_s, compute_s=best.compute_s + best.noise_s,
                      comm_s=sum(b.comm_s for b in spans),
                      codec_s=sum(b.encode_s + b.decode_s for b in spans), codec_steals_compute=best.steals,
                      hosts=len(best.layout.hosts))
    priced = []
    for text in SHOWN:
        spec = parse_sync_spec(text)
        step = kind(spec).step_s(spec, parts)
        record = (guarded or {}).get(text)
        factor = "" if record is None else (
            f", {record.factor:.2f}x the samples by the guard: {best.step_s / (step * record.factor):.2f}x to fp32's loss"
            if record.factor is not None else ", loss above fp32's first evaluation in the guard")
        priced.append(f"{text} {_ms(step)} ({best.step_s / step:.2f}x{factor})")
    codec = best.layout.codecs[0]
    return [f"Sync modes on uniform DDP with {codec} (`thinwire train --sync MODE --compression {codec}`, not with "
            f"this plan), predicted per step against its {_ms(best.step_s)}: {'; '.join(priced)}. Their loss at equal "
            "samples is measured, not predicted (the convergence guard runs delayed; local SGD and DiLoCo average "
            "beyond its short run): on charlm at 4 hosts x 100 Mbit/s none of them reached DDP fp32's loss in as many "
            "samples (benchmarks/results/sync_emulated.md)."]


def pipeline_lines(pipe, profile, ddp_s: float | None, fits_one: bool) -> list[str]:
    """Why this pipeline: what each stage holds and takes, the links' formats, against an even split and DDP."""
    stages = "; ".join(f"{s.host}: {'+'.join(s.layers) if len(s.layers) <= 3 else s.layers[0] + '..' + s.layers[-1]} "
                       f"({s.parameters:,} parameters, {s.memory_bytes / 2**20:.1f} MiB, {_ms(s.seconds_per_microbatch)} "
                       "per micro-batch)" for s in pipe.stages)
    head = ("No host can hold the model with its gradients, optimizer state and one sample's activations, so data "
            "parallelism is impossible here; a pipeline splits it." if not fits_one else
            "A pipeline over the hosts (asked for with --pipeline).")
    links = "/".join(pipe.links) if pipe.links else "none"
    lines = [head,
             f"{len(pipe.stages)} stages" + (f", {pipe.virtual} per host" if pipe.virtual > 1 else "")
             + f", {pipe.schedule.upper()} over {pipe.microbatches} micro-batches"
             + (", activations recomputed in backward to fit memory" if pipe.recompute else "") + f": {stages}.",
             f"Links between stages carry activations as {links} (compressed only where the link paces the "
             f"pipeline). Predicted step {_ms(pipe.predicted_step_s)}; the pace is set by {pipe.bottleneck}.",
             f"Split by measured host speed and memory: the even split by parameters ({'/'.join(map(str, pipe.even_split))} "
             f"layers) is predicted at {_ms(pipe.even_split_step_s)} "
             f"({pipe.even_split_step_s / pipe.predicted_step_s:.2f}x this plan's step)."]
    for other, step in pipe.alternative_step_s.items():
        why = ("not 3% faster: its half bubble does not repay twice the hand-overs and its runtime's cost per "
               "micro-batch" if other == "interleaved" else "its bubble is twice the interleaved schedule's")
        lines.append(f"The best {other} plan is predicted at {_ms(step)} ({step / pipe.predicted_step_s:.2f}x this "
                     f"plan's step; {why}).")
    if pipe.left_out:
        lines.append(f"Leaving out {_listing(pipe.left_out)}: " + (
            f"the best pipeline over every host is predicted at {_ms(pipe.with_all_hosts_step_s)} per step "
            f"({pipe.with_all_hosts_step_s / pipe.predicted_step_s:.2f}x this plan's): a stage on a slower host paces "
            "every micro-batch." if pipe.with_all_hosts_step_s is not None else
            "no pipeline over every host fits their memory."))
    if ddp_s is not None:
        lines.append(f"Uniform DDP fp32 over every host that holds the model is predicted at {_ms(ddp_s)} per step "
                     f"({ddp_s / pipe.predicted_step_s:.2f}x the pipeline's).")
    lines.append(f"With --plan, the run is --pipeline {pipe.spec_text()} on these hosts.")
    return lines
