"""``thinwire simulate``: predict step time, scaling, bytes and energy of a workload on a cluster spec."""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thinwire.cli.common import COMMANDS, add_workload_args, wide_console, workload_of
from thinwire.config import check, check_outputs, check_writable, mark_outputs, new_folder
from thinwire.errors import ConfigError

EPILOG = """examples:
  thinwire simulate --cluster examples/clusters/uneven-4.yaml --workload charlm --profile p.yaml
  thinwire simulate --cluster examples/clusters/pair-100mbit.yaml --profile p.yaml --compression bf16 \\
                    --hosts 2,4,...,1024 --out runs/sim
  sudo thinwire simulate --cluster examples/clusters/pair-100mbit.yaml --profile p.yaml --validate --steps 30
"""


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help=COMMANDS["simulate"],
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, help="cluster spec YAML")
    add_workload_args(p, from_profile=True)
    p.add_argument("--profile", help="profile YAML from `thinwire profile` (default: measure now: 1-2 min, most of it the co-running hosts' probe; save one with `thinwire profile` and pass it)")
    p.add_argument("--compression", default="none", help="codec spec, e.g. bf16, topk:ratio=0.01")
    p.add_argument("--aggregation", default="ring", choices=["ring", "switch"],
                   help="switch: int8 buckets through an aggregator on the switch (`train --aggregation switch`)")
    p.add_argument("--sync", default="allreduce", metavar="MODE",
                   help="also price a sync mode: delayed, local:period=H, diloco:period=H[,fragments=F] (columns next to "
                   "allreduce's), or all: a table of the modes side by side")
    p.add_argument("--pipeline", metavar="SCHEDULE", help="also price a pipeline over the spec's hosts, e.g. 1f1b, "
                   "gpipe:layers=2/1/1,activations=int8 (as `train --pipeline`), beside data parallelism")
    p.add_argument("--hosts", help="host counts, increasing: 2,3,4, or a series A,B,...,Z that multiplies by B/A where A "
                   "divides B (2,4,...,1024) and else adds B-A (3,5,...,11) (default: the spec's own)")
    p.add_argument("--batch-size", type=int, help="global batch (default: the workload's)")
    p.add_argument("--scaling", default="weak", choices=["weak", "strong"],
                   help="weak: fixed batch per host (default); strong: fixed global batch")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: the profile's)")
    p.add_argument("--colocated", type=float, metavar="CORES",
                   help="all hosts share CORES cores, as on an emulated cluster (default: separate machines)")
    p.add_argument("--device", default="xeon-8380-core", help="device table entry for energy (see thinwire.perf.devices)")
    p.add_argument("--mfu", type=float, help="take compute from --device's peak FLOP/s at this utilization "
                   "(e.g. 0.4) and the profile's FLOPs, instead of the measured time")
    p.add_argument("--j-per-bit", type=float, help="network energy per bit (default: Aslan et al. 2018's "
                   "wide-area 2.7e-5 J/bit; a LAN costs far less)")
    p.add_argument("--steps", type=int, help="steps of the run (energy per run; with --validate, steps to train)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", help="folder for simulate.json and the PNGs (default runs/simulate-SPEC-TIME)")
    p.add_argument("--validate", action="store_true", help="also run each configuration for real (root)")
    p.add_argument("--max-foreign", type=float, metavar="CORES",
                   help="with --validate: wait until other processes use at most CORES, and repeat a run "
                        "during which they used more (up to --retries times)")
    p.add_argument("--retries", type=int, default=2, help="with --max-foreign: how often a run is repeated")
    p.add_argument("--recompute", action="store_true",
                   help="with --validate: measure the workload's step again (as the profile did, a few seconds) "
                        "right before each run and predict with it, for a machine whose speed drifts")
    p.set_defaults(func=run)


def parse_hosts(text: str) -> list[int]:
    """``"2,3,4"``; ``"2,4,...,1024"`` continues the last two terms' ratio (or step) up to the last."""
    allowed = "comma-separated host counts >= 1, optionally A,B,...,Z (e.g. 2,4,...,1024)"
    parts = [t.strip() for t in text.split(",")]
    check(all(parts), "--hosts", text, allowed, "Every comma separates two host counts: 2,4,8.")
    try:
        values = [int(t) for t in parts if t != "..."]
    except ValueError:
        raise ConfigError("--hosts", text, allowed) from None
    check(bool(values) and min(values) >= 1, "--hosts", text, allowed)
    from thinwire.sim.inputs import MAX_HOSTS

    check(max(values) <= MAX_HOSTS, "--hosts", text, f"host counts in [1, {MAX_HOSTS}]")
    listed = values if "..." not in parts else values[:-2]  # a series' own terms are checked below
    check(all(a < b for a, b in zip(listed, listed[1:])), "--hosts", text,
          "host counts in increasing order, each once", "List them as 2,4,8 or 2,4,...,16.")
    if "..." not in parts:
        return values
    check(len(parts) >= 4 and parts[-2] == "..." and parts.count("...") == 1, "--hosts", text, allowed)
    a, b, z = values[-3], values[-2], values[-1]
    check(a < b <= z, "--hosts", text, allowed, "The terms must grow: 2,4,...,1024.")
    out, x = values[:-1], (b * b // a if b % a == 0 else 2 * b - a)
    while x <= z:
        out.append(x)
        check(len(out) <= MAX_POINTS, "--hosts", text, f"a sweep of at most {MAX_POINTS} host counts",
              "Take larger steps (2,4,...,1024 doubles) or a shorter range.")
        x = x * b // a if b % a == 0 else x + (b - a)
    if out[-1] != z:  # the series passes the last term by: say so rather than stop short of it in silence
        rule = f"multiplies by {b // a}" if b % a == 0 else f"adds {b - a}"
        raise ConfigError("--hosts", text, allowed, f"{a},{b},... {rule} at each term, which passes {z} by: it goes "
                          f"{out[-1]}, {x}. End the series at one of them, or list the counts.")
    return out


SIM_FILES = ("simulate.json", "scaling.png", "timeline.png")  # what simulate writes into --out
MAX_POINTS = 256  # host counts one --hosts sweep may expand to (each is simulated)


def run(args: argparse.Namespace) -> int:
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.sim.sweep import SimOptions
    from thinwire.workloads.registry import check_workload_name

    check_writable(args.out or "runs", "--out", folder=True)  # the default folder goes under runs/
    if args.out:
        check_outputs(args.out, SIM_FILES, "simulate")
    args.workload, model = workload_of(args)
    check_workload_name(args.workload)
    spec = load_cluster_spec(args.cluster)
    from thinwire.cluster.spec import unpriced_loss

    if note := unpriced_loss(spec):
        print(f"thinwire: {note}", file=sys.stderr)
    from thinwire.commspec import CodecSpec, parse_comm_spec

    comm = parse_comm_spec(args.compression)
    check(isinstance(comm, CodecSpec), "--compression", args.compression, "a codec spec such as bf16 or int8",
          "simulate prices one codec on every bucket; for auto's choice run `thinwire plan`.")
    check(args.batch_size is None or args.batch_size >= 1, "--batch-size", args.batch_size, "an integer >= 1")
    check(args.steps is None or args.steps >= 1, "--steps", args.steps, "an integer >= 1")  # 0 was the default
    check(args.validate or not args.recompute, "--recompute", True, "used with --validate",
          "Add --validate, or drop --recompute (it re-measures the step before each real run).")
    check(args.max_foreign is None or (args.validate and args.max_foreign >= 0), "--max-foreign", args.max_foreign,
          "a number of cores >= 0, used with --validate", "It holds --validate's runs until the machine is that quiet.")
    check(args.retries >= 0, "--retries", args.retries, "an integer >= 0 (runs repeated when the machine was busy)")
    from thinwire.commspec import check_sync_pairing
    from thinwire.syncspec import parse_sync_spec

    sync = parse_sync_spec("allreduce" if args.sync == "all" else args.sync)
    sync = check_sync_pairing(sync, comm)  # auto:guard= resolved: delayed ruled out by the guard is not priced
    check(not (args.validate and sync.mode != "allreduce"), "--sync", args.sync, "allreduce with --validate",
          "--validate runs allreduce only; simulate the mode without it.")
    check(args.aggregation != "switch" or spec.switch is not None, "--aggregation", "switch",
          f"a cluster spec with a switch: section ({args.cluster} has none)",
          "Add switch: (the aggregator's cpu and link) to the spec, as `thinwire train --aggregation switch` needs, or "
          "leave --aggregation out.")
    hosts = parse_hosts(args.hosts) if args.hosts else None
    if args.pipeline:  # its mistakes before the profile's minutes of measuring, as train names them
        from thinwire.pipespec import parse_pipeline_spec

        parse_pipeline_spec(args.pipeline)
    if sync.mode == "gossip":  # a topology a host count cannot form is refused, as train refuses it
        from thinwire.compress.sync.gossip import check_topology

        for p in hosts or [len(spec.hosts)]:
            check_topology(sync.topology, p)
    opts = SimOptions(codec=args.compression, hosts=hosts, batch_size=args.batch_size, scaling=args.scaling,
                      threads=args.threads, colocated_cores=args.colocated, device=args.device, mfu=args.mfu,
                      steps=args.steps or 1000, sync=sync, aggregation=args.aggregation,
                      **({"j_per_bit": args.j_per_bit} if args.j_per_bit is not None else {}))
    profile, default_batch = _profile(args, model)
    if args.out:
        out = Path(args.out)
    else:
        made = [p for p in (Path("runs"),) if not p.exists()]
        out = new_folder(Path("runs") / f"simulate-{spec.name}-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        made.insert(0, out)
    try:
        if args.validate:
            return _validate(args, spec, profile, opts, model, default_batch, out)
        return _simulate(args, spec, profile, opts, default_batch, out)
    except BaseException:
        for folder in [] if args.out else made:  # the default folder this run made, if it stopped before any file
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _profile(args, model: dict):
    from thinwire.measure.file import load_profile
    from thinwire.sim.inputs import check_profile_matches
    from thinwire.workloads.registry import build_workload

    wl = build_workload(args.workload, model, args.data)
    default_batch = wl.batch_size
    if args.profile:
        profile = load_profile(args.profile)
        check_profile_matches(profile, args.workload, model, parameters=sum(p.numel() for p in wl.model.parameters()))
        return profile, default_batch
    from thinwire.cli.profile import batch_sizes
    from thinwire.measure.run import profile_workload

    Console(stderr=True).print("no --profile: measuring this machine now (save one with `thinwire profile`)")
    sizes = batch_sizes(argparse.Namespace(batch_sizes=None, batch_size=args.batch_size), default_batch)
    return profile_workload(workload=args.workload, model=model, data=args.data, batch_sizes=sizes,
                            codecs=sorted({"none", args.compression}), reps=6), default_batch


def _simulate(args, spec, profile, opts, default_batch: int, out: Path) -> int:
    from thinwire.sim import output
    from thinwire.sim.inputs import one_point_note
    from thinwire.sim.sweep import simulate

    t0 = time.perf_counter()
    points = simulate(spec, profile, opts, default_batch=default_batch)
    elapsed = time.perf_counter() - t0
    meta = {"cluster": spec.name, "workload": args.workload, "compression": opts.codec, "sync": args.sync, "scaling": opts.scaling,
            "device": opts.device, "steps": opts.steps, "simulate_seconds": elapsed,
            "profile": args.profile, "colocated_cores": opts.colocated_cores}
    own = next((pt for pt in points if pt.p == len(spec.hosts)), points[0])
    # the pipeline's table first: a --pipeline the layout refuses stops before anything is written
    none = (None, None)
    pipeline, pipeline_row = _pipeline_table(args, spec, profile, opts, default_batch, own) if args.pipeline else none
    sync_table, sync_rows = _sync_table(spec, profile, opts, default_batch, own) if args.sync == "all" else none
    meta.update({k: v for k, v in (("pipeline", pipeline_row), ("sync_modes", sync_rows)) if v is not None})
    out.mkdir(parents=True, exist_ok=True)
    mark_outputs(out, "simulate")
    (out / "simulate.json").write_text(output.to_json(points, meta))
    title = f"{args.workload} on {spec.name}, {opts.codec}"
    output.plot_scaling(points, out / "scaling.png", title)
    output.plot_timeline(own, out / "timeline.png", f"{title}, {own.p} hosts")
    if args.json:
        print(output.to_json(points, meta))
        return 0
    console = wide_console()
    console.print(output.table(points, f"predicted: {title} ({opts.scaling} scaling)"))
    if sync_table is not None:
        console.print(sync_table)
    if pipeline is not None:
        console.print(pipeline)
    uneven = [pt for pt in points if pt.batch_per_host != int(pt.batch_per_host)]
    if uneven:  # priced as a fractional batch per host, which no run can have
        if opts.scaling == "strong":
            what = "; ".join(f"{pt.batch_per_host * pt.p:g} samples over {pt.p} hosts is {pt.batch_per_host:.3g} each"
                             for pt in uneven)
            fix = f"a --batch-size that every host count divides, e.g. {_common_batch(points)}"
        else:
            k = len(spec.hosts)
            what = f"--batch-size {own.batch_per_host * k:g} over the spec's {k} hosts is {own.batch_per_host:.3g} each"
            fix = f"a --batch-size that {k} divides, e.g. {_common_batch([own], k)}"
        console.print(f"[yellow]{what} (priced as such): `thinwire train` refuses a batch its workers cannot share "
                      f"equally. Give {fix}.[/yellow]")
    if note := one_point_note(profile, [pt.batch_per_host for pt in points]):
        console.print(f"[yellow]{note}[/yellow]")
    short = [h for h in spec.hosts if h.memory is not None and h.memory < own.memory.total]
    if short:  # the model prices time only: a host that cannot hold a rank would refuse the run
        # as many decimals as tell each host's memory from the need (237 MiB "below" 237 MiB read as a mistake)
        digits = next((d for d in range(4) if all(round(h.memory / 2**20, d) < round(own.memory.total / 2**20, d)
                                                   for h in short)), 4)
        console.print(f"[yellow]{', '.join(f'{h.name} ({h.memory / 2**20:.{digits}f} MiB)' for h in short)}: below "
                      f"the {own.memory.total / 2**20:.{digits}f} MiB ({own.memory.total / 1e6:.{digits}f} MB) a rank "
                      "needs here (mem/rank): training there would be refused or killed; `thinwire plan` leaves such "
                      "hosts out or pipelines the model.[/yellow]")
    console.print(f"simulated {len(points)} host count(s) in {elapsed * 1e3:.0f} ms; wrote {out}/simulate.json, "
                  "scaling.png, timeline.png")
    return 0


def _common_batch(points, hosts: int | None = None) -> int:
    """The smallest batch at least the points' largest global batch that each of their host counts divides
    (``hosts``: a --batch-size that ``hosts`` divide, the weak-scaling batch of the spec's hosts)."""
    import math

    lcm = hosts or math.lcm(*(pt.p for pt in points))
    batch = hosts * points[0].batch_per_host if hosts else max(pt.batch_per_host * pt.p for pt in points)
    return lcm * math.ceil(batch / lcm - 1e-9)


def _pipeline_table(args, spec, profile, opts, default_batch: int, own) -> tuple[Table, dict]:
    """``--pipeline``: the pipeline's predicted step and its parts, against data parallelism on the same hosts
    (a table, and its numbers for simulate.json)."""
    from thinwire.pipeline.layout import layout
    from thinwire.pipespec import parse_pipeline_spec
    from thinwire.sim.output import _ms
    from thinwire.sim.pipeline import needs_layers, predict_pipeline

    needs_layers(profile)
    pipe = parse_pipeline_spec(args.pipeline)
    lay = layout(pipe, [l.name for l in profile.layers], [l.parameters for l in profile.layers], len(spec.hosts),
                 args.batch_size or default_batch)
    stage_hosts = list(spec.hosts)[: lay.stages]
    pred = predict_pipeline(spec, profile, stage_hosts, lay.runs, microbatches=lay.microbatches,
                            replica_batch=lay.replica_batch, activations=lay.links, replicas=lay.replicas,
                            threads=opts.threads or profile.threads, colocated_cores=opts.colocated_cores,
                            recompute=pipe.recompute, schedule=pipe.schedule)
    stale = ("; this profile has no interleaved runtime's overhead (`thinwire profile` measures it now): priced at "
             "1F1B's per stage, which is low" if pipe.schedule == "interleaved" and profile.interleaved_overhead_s is None
             else "")
    t = Table(title=f"pipeline {pipe.text}: {lay.describe()}; predicted {_ms(pred.step_s)} per step "
                    f"({own.prediction.step_s / pred.step_s:.2f}x data parallelism's {_ms(own.prediction.step_s)}); "
                    f"paced by {pred.bottleneck}{stale}")
    for col in ("stage", "host", "layers", "compute / micro-batch", "sending / micro-batch", "link to next"):
        t.add_column(col, justify="left" if col in ("host", "layers") else "right")
    rows = [{"stage": s, "host": stage_hosts[s % lay.stages].name, "layers": [lay.layer_names[i] for i in run],
             "compute_s_per_microbatch": pred.stage_s[s], "sending_s_per_microbatch": pred.send_s[s],
             "link_to_next": lay.links[s] if s < len(lay.links) else None} for s, run in enumerate(lay.runs)]
    for r in rows:
        t.add_row(str(r["stage"]), r["host"], "+".join(r["layers"]), _ms(r["compute_s_per_microbatch"]),
                  _ms(r["sending_s_per_microbatch"]), r["link_to_next"] or "-")
    return t, {"spec": pipe.text, "layout": lay.describe(), "predicted_step_s": pred.step_s,
               "data_parallel_step_s": own.prediction.step_s, "paced_by": pred.bottleneck,
               "microbatches": lay.microbatches, "stages": rows}


def _sync_table(spec, profile, opts, default_batch: int, own):
    """``--sync all``: every mode of :data:`thinwire.syncspec.SHOWN` at the cluster's own host count (a table,
    and its rows for simulate.json)."""
    import dataclasses

    from rich.table import Table

    from thinwire.sim.output import _bytes, _ms
    from thinwire.sim.sweep import simulate
    from thinwire.syncspec import SHOWN, parse_sync_spec

    t = Table(title=f"sync modes at {own.p} hosts, {opts.codec} (loss at equal samples: measured, not predicted)")
    for col in ("mode", "step", "vs allreduce", "wire/step"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    rows = [{"sync": "allreduce", "hosts": own.p, "step_s": own.prediction.step_s, "speedup": 1.0,
             "bytes_per_step": own.prediction.bytes_per_rank}]
    for text in SHOWN:
        pts = simulate(spec, profile, dataclasses.replace(opts, sync=parse_sync_spec(text), hosts=[own.p]),
                       default_batch=default_batch)
        pt = pts[0]
        rows.append({"sync": text, "hosts": own.p, "step_s": pt.sync_step_s,
                     "speedup": own.prediction.step_s / pt.sync_step_s, "bytes_per_step": pt.sync_bytes_per_step})
    for r in rows:
        t.add_row(r["sync"], _ms(r["step_s"]), f"{r['speedup']:.2f}x", _bytes(r["bytes_per_step"]))
    return t, rows


def _validate(args, spec, profile, opts, model: dict, default_batch: int, out: Path) -> int:
    from thinwire.validation import remeasure, validate

    steps = args.steps or 30
    check(steps > 10, "--steps", steps, "more than 10 with --validate (the first 5 steps are skipped)")
    rows = validate(spec, profile, opts, workload=args.workload, model=model,
                    batch=args.batch_size or default_batch, steps=steps, out=out, max_foreign=args.max_foreign,
                    retries=args.retries if args.max_foreign is not None else 0,
                    recompute=remeasure(profile) if args.recompute else None)
    t = Table(title=f"predicted vs measured median step time ({args.workload}, {opts.codec})")
    drift = args.recompute
    for col in ("hosts", "predicted ms", "measured ms", "error", "bytes/rank predicted", "measured", "other procs",
                "predicted w/o their cores", *(["step re-measured vs profile"] if drift else [])):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.hosts), f"{r.predicted_s * 1e3:.1f}", f"{r.measured_s * 1e3:.1f}", f"{r.error:+.1%}",
                  f"{r.predicted_bytes:,}", f"{r.measured_bytes:,.0f}", f"{r.foreign_cores:.2f} cores",
                  f"{r.predicted_loaded_s * 1e3:.1f}", *([f"{r.compute_drift - 1:+.0%}"] if drift else []))
    wide_console().print(t)
    if any(r.foreign_cores > 0.1 for r in rows):
        Console().print("[yellow]other processes used CPU during a run: its hosts computed slower than the spec "
                        "says, and the error above includes that[/yellow]")
    if args.json:
        import json

        print(json.dumps([r.to_dict() for r in rows], indent=2))
    return 0
