"""``thinwire plan``: choose batch shares, hosts, grouping and codecs for a cluster; write and explain the plan."""

from __future__ import annotations

import argparse
import functools
import math
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from thinwire.cli.common import COMMANDS, add_workload_args, split_codecs, workload_of
from thinwire.compress.spec import default_candidates
from thinwire.config import check, check_writable
from thinwire.errors import ConfigError
from thinwire.plan.choose import MAX_EF_ERROR
from thinwire.train.config import TrainConfig

EPILOG = """examples:
  thinwire profile --workload charlm --out charlm.profile.yaml
  thinwire plan --cluster examples/clusters/plan-a-slow-cpu.yaml --workload charlm --profile charlm.profile.yaml \\
                --batch-size 32 --out plan.yaml
  thinwire plan --cluster examples/clusters/plan-b-two-groups.yaml --workload charlm --set model.width=256 \\
                --codecs none,bf16,int8 --colocated 2 --out plan.yaml  # no --profile: measures (1-2 min, the guard too)
  thinwire train --cluster examples/clusters/plan-a-slow-cpu.yaml --plan plan.yaml
"""


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help=COMMANDS["plan"],
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True, help="cluster spec YAML (the one the emulator and simulator read)")
    add_workload_args(p, from_profile=True)
    p.add_argument("--batch-size", type=int, help="global batch per step (default: the workload's)")
    p.add_argument("--profile", help="profile YAML from `thinwire profile` (default: measure this machine now)")
    p.add_argument("--codecs", help="candidate codecs, lightest first, comma-separated "
                   f"(default: {','.join(default_candidates())})")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: the profile's)")
    p.add_argument("--colocated", type=float, metavar="CORES",
                   help="all hosts share CORES cores, as on an emulated cluster (default: separate machines)")
    p.add_argument("--device", help="with --mfu: take compute from this device table entry's peak FLOP/s")
    p.add_argument("--mfu", type=float, help="utilization of --device's peak (e.g. 0.4)")
    p.add_argument("--keep", type=int, default=6, help="alternatives kept in the plan file (default 6)")
    p.add_argument("--rank", choices=("time", "step"), default="time",
                   help="time (default): rank by predicted time to DDP fp32's loss, (step time + the run's validation "
                        "per step) x each codec's sample factor from the profile's convergence guard; step: by step "
                        "time alone (with --max-error)")
    p.add_argument("--max-error", type=float, default=MAX_EF_ERROR,
                   help="with --rank step: leave out codecs whose relative error with error feedback on this "
                        f"workload's gradients is above this (default {MAX_EF_ERROR}, as auto's)")
    p.add_argument("--pipeline", action="store_true", help="plan a pipeline over the hosts (the layer list split by "
                   "host speed and memory), also where data parallelism fits; planned anyway where it does not")
    p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every,
                   help="the run validates every this many steps, as `train --eval-every`; its validation, split "
                        f"over the plan's hosts, counts in the time to target (default {TrainConfig.eval_every}, "
                        "train's; 0: leave validation out)")
    p.add_argument("--eval-batches", type=int, default=TrainConfig.eval_batches,
                   help=f"... on this many global batches, as train's eval_batches (default {TrainConfig.eval_batches}; "
                        "0: the whole validation set)")
    p.add_argument("--out", required=True, help="plan YAML to write")
    p.set_defaults(func=run)


def codec_list(text: str | None) -> tuple[str, ...]:
    from thinwire.compress.spec import parse_codec_spec

    if text is None:
        return default_candidates()
    items = split_codecs(text)
    for c in items:
        parse_codec_spec(c)
    return items if "none" in items else ("none", *items)


def run(args: argparse.Namespace) -> int:
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.plan.planfile import save_plan
    from thinwire.plan.planner import PlanOptions, make_plan
    from thinwire.workloads.registry import build_workload, check_workload_name

    check_writable(args.out, "--out", folder=False, inputs={"--cluster": args.cluster, "--profile": args.profile},
                   kind=("plan", ("version", "cluster", "workload", "executable")))
    args.workload, model = workload_of(args)
    check_workload_name(args.workload)
    spec = load_cluster_spec(args.cluster)
    from thinwire.cluster.spec import unpriced_loss

    if note := unpriced_loss(spec):
        print(f"thinwire: {note}", file=sys.stderr)
    codecs = codec_list(args.codecs)
    built = functools.cache(lambda: build_workload(args.workload, model, args.data))  # built once, if at all
    if args.pipeline and not args.profile:  # before minutes of profiling: a model without a layer list is refused
        from thinwire.pipeline.stages import layer_list

        layer_list(built().model, built().layers, args.workload)
    check(args.batch_size is None or args.batch_size >= 1, "--batch-size", args.batch_size, "an integer >= 1")
    batch = args.batch_size or built().batch_size
    opts = PlanOptions(batch_size=batch, codecs=codecs, threads=args.threads, colocated_cores=args.colocated,
                       device=args.device, mfu=args.mfu, keep=args.keep, max_error=args.max_error, rank=args.rank,
                       pipeline=args.pipeline, eval_every=args.eval_every, eval_batches=args.eval_batches)
    profile = _profile(args, model, batch, len(spec.hosts), codecs, guard=args.rank == "time" and not args.pipeline,
                       built=built)
    plan = make_plan(spec, profile, workload=args.workload, model=model, options=opts)
    path = save_plan(plan, args.out)
    show(plan)
    from thinwire.sim.inputs import one_point_note

    shares = [x for d in (plan.chosen, *plan.alternatives) if d is not None for x in d.shares]
    if note := one_point_note(profile, shares):
        Console().print(f"[yellow]{note}[/yellow]")
    Console().print(f"wrote {path} (planned in {plan.planning['seconds'] * 1e3:.0f} ms, "
                    f"{plan.planning['candidates_scored']} candidates priced)")
    Console().print(f"run it: {run_command(args, model, path)}", highlight=False, soft_wrap=True)
    return 0


def run_command(args: argparse.Namespace, model: dict, path) -> str:
    """The `thinwire train` that runs the plan: its cluster, workload, model options, data and batch, which the
    plan was made for (a plan for another workload is refused), as they were given here."""
    import shlex

    parts = ["thinwire", "train", "--cluster", args.cluster, "--plan", str(path), "--workload", args.workload]
    parts += [a for k, v in model.items() for a in ("--set", f"model.{k}={v}")]
    parts += ["--data", args.data] if args.data else []
    parts += ["--batch-size", str(args.batch_size)] if args.batch_size else []
    return " ".join(shlex.quote(p) for p in parts)


def _profile(args, model: dict, batch: int, hosts: int, codecs: tuple[str, ...], guard: bool, built):
    """``built()``: the workload (built once)."""
    from thinwire.measure.file import load_profile

    if args.profile:
        from thinwire.sim.inputs import check_profile_matches

        profile = load_profile(args.profile)
        wl = built()  # the model it builds now, against the one measured
        check_profile_matches(profile, args.workload, model, parameters=sum(p.numel() for p in wl.model.parameters()),
                              what="the plan")
        return profile
    from thinwire.measure.run import profile_workload

    per = max(1, math.ceil(batch / hosts))
    sizes = sorted({max(1, per // 2), per, min(batch, 2 * per)}, reverse=True)
    Console(stderr=True).print(f"no --profile: measuring {args.workload} on this machine at per-host batches {sizes}"
                               + (", and the convergence guard (60 steps per codec)" if guard else "")
                               + " (save one with `thinwire profile` to skip this)")
    from thinwire.measure.convergence import GUARD_STEPS

    return profile_workload(workload=args.workload, model=model, data=args.data, batch_sizes=sizes,
                            threads=args.threads or 1, codecs=list(codecs), reps=6, guard_steps=GUARD_STEPS if guard else 0)


def show(plan) -> None:
    console = Console()
    if plan.pipeline is not None:
        _show_pipeline(console, plan)
    else:
        console.print(candidates_table(plan))
        console.print(hosts_table(plan))
    for line in plan.explanation:
        console.print(f"- {escape(line)}", highlight=False)


def _time_s(plan, d) -> float:
    """A decision's time per step to fp32's loss as the planner ranks it: its step and its share of validation,
    times the samples it needs."""
    every = (plan.planning or {}).get("validation", {}).get("every") or 0
    return (d.predicted_step_s + (d.validation_s / every if every else 0.0)) * d.sample_factor


def candidates_table(plan) -> Table:
    # the ranking's own quantity (validation included); a plan from before it kept it: steps only
    timed = "uniform_ddp_fp32_time_s" in plan.baselines
    base = plan.baselines.get("uniform_ddp_fp32_time_s" if timed else "uniform_ddp_fp32_s")
    t = Table(title=f"plan for {plan.workload} on {plan.cluster}, global batch {plan.global_batch} "
                    "(predicted by the performance model)")
    for col in ("#", "plan", "step ms", "samples x", "time to fp32 loss vs uniform fp32", "compute ms",
                "exposed comm ms", "MB/step"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for i, d in enumerate([plan.chosen, *plan.alternatives]):
        t.add_row("chosen" if i == 0 else str(i), escape(d.name), f"{d.predicted_step_s * 1e3:.1f}",
                  f"{d.sample_factor:.2f}", f"{base / (_time_s(plan, d) if timed else d.predicted_step_s * d.sample_factor):.2f}x" if base else "-",
                  f"{d.compute_s * 1e3:.1f}", f"{d.exposed_comm_s * 1e3:.1f}", f"{d.bytes_per_step / 1e6:.2f}",
                  style="bold" if i == 0 else None)
    return t


def hosts_table(plan) -> Table:
    d = plan.chosen
    leaders = {g[0] for g in d.groups}
    t = Table(title=f"chosen: {d.collective}, codecs {', '.join(sorted(set(d.codecs)))}")
    for col in ("rank", "host", "share", "micro-batch", "role"):
        t.add_column(col, justify="right" if col != "host" else "left")
    for r, (h, s, m) in enumerate(zip(d.hosts, d.shares, d.micro)):
        role = "group leader" if h in leaders else ("group member" if d.groups else "ring")
        t.add_row(str(r), h, str(s), str(m), role)
    for h in d.left_out:
        t.add_row("-", h, "-", "-", "left out", style="dim")
    return t


def _show_pipeline(console: Console, plan) -> None:
    p = plan.pipeline
    t = Table(title=f"pipeline for {plan.workload} on {plan.cluster}, global batch {plan.global_batch}: "
                    f"{p.schedule.upper()}, {p.microbatches} micro-batches, predicted {p.predicted_step_s * 1e3:.1f} ms/step")
    for col in ("stage", "host", "layers", "parameters", "MiB", "ms/micro-batch", "link to next"):
        t.add_column(col, justify="left" if col in ("host", "layers") else "right")
    for i, s in enumerate(p.stages):
        names = "+".join(s.layers) if len(s.layers) <= 3 else f"{s.layers[0]}..{s.layers[-1]} ({len(s.layers)})"
        t.add_row(str(i), s.host, names, f"{s.parameters:,}", f"{s.memory_bytes / 2**20:.1f}",
                  f"{s.seconds_per_microbatch * 1e3:.2f}", p.links[i] if i < len(p.links) else "-")
    console.print(t)
