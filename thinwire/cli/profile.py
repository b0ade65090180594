"""``thinwire profile``: measure a workload, its codecs and (optionally) the network; write a profile YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thinwire.cli.common import COMMANDS, add_workload_args, model_options, split_codecs
from thinwire.compress.spec import REGISTRY, default_candidates, parse_codec_spec, spec_string
from thinwire.config import check, check_writable
from thinwire.errors import ConfigError
from thinwire.measure.foreign import ForeignCpu, busy_warning


EPILOG = """examples:
  thinwire profile --workload charlm --out charlm.profile.yaml
  thinwire profile --workload charlm --set model.width=256 --batch-sizes 12,8,6 --codecs none,bf16,topk --out p.yaml
  sudo thinwire profile --workload charlm --cluster examples/clusters/pair-100mbit.yaml --out p.yaml   # + alpha/beta
"""


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help=COMMANDS["profile"],
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--batch-size", type=int, help="global batch: measures per-rank batches B, B/2, B/4")
    p.add_argument("--batch-sizes", help="per-rank batch sizes to measure, e.g. 12,8,6 (overrides --batch-size)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap, as `train --set bucket_mb=`")
    p.add_argument("--threads", type=int, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--codecs", help="comma-separated codec specs (default: every codec with default parameters, and "
                   "the specs plan, auto and doctor try: " + ", ".join(default_candidates()) + ")")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per measurement")
    p.add_argument("--cluster", help="a running emulated cluster spec: also probe latency and bandwidth, and run the "
                   "step on every host at once for their speeds (root)")
    p.add_argument("--no-host-speed", dest="host_speed", action="store_false",
                   help="with --cluster: probe the network only, not each host's speed (the model then takes a "
                        "host's cpu from the spec)")
    p.add_argument("--no-corun", dest="corun", action="store_false",
                   help="skip measuring the step with every core busy (needed to simulate an emulated cluster), "
                        "the host CPU of an all-reduce and that of a switch's aggregator")
    p.add_argument("--guard-steps", type=int,
                   help="steps of each codec's convergence-guard run against fp32, from the workload's initial "
                        "weights at the largest batch, on 3 data orders (default 60, thinwire.measure.convergence.GUARD_STEPS; "
                        "0 skips the guard, and `plan` then ranks by step time)")
    p.add_argument("--out", required=True, help="profile YAML to write")
    p.set_defaults(func=run)


def parse_ints(text: str, field: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(field, text, "comma-separated integers such as 12,8,6") from None
    check(bool(values) and min(values) >= 1, field, text, "comma-separated integers >= 1")
    return values


def batch_sizes(args, default_batch: int) -> list[int]:
    if args.batch_sizes:
        return parse_ints(args.batch_sizes, "--batch-sizes")
    b = default_batch if args.batch_size is None else args.batch_size  # 0 is refused, not the default
    check(b >= 1, "--batch-size", b, "an integer >= 1")
    return sorted({max(1, b // d) for d in (1, 2, 4)}, reverse=True)


def run(args: argparse.Namespace) -> int:
    from thinwire.measure.file import save_profile
    from thinwire.measure.convergence import GUARD_STEPS
    from thinwire.measure.run import profile_workload
    from thinwire.workloads.registry import build_workload, check_workload_name

    check_writable(args.out, "--out", folder=False, inputs={"--cluster": args.cluster, "--data": args.data},
                   kind=("profile", ("version", "workload", "compute")))
    args.workload = args.workload or "charlm"
    check_workload_name(args.workload)
    model = model_options(args.set)
    codecs = list(split_codecs(args.codecs)) if args.codecs is not None else default_profile_codecs()
    for c in codecs:
        parse_codec_spec(c)
    network_spec = _cluster(args.cluster) if args.cluster else None
    default_batch = build_workload(args.workload, model, args.data).batch_size
    sizes = batch_sizes(args, default_batch)
    network = None
    if network_spec is not None:
        from thinwire.measure.network import probe_network

        network = probe_network(network_spec)
    with ForeignCpu() as foreign:  # other processes' CPU while measuring: they slow what is measured
        prof = profile_workload(workload=args.workload, model=model, data=args.data, batch_sizes=sizes,
                                bucket_mb=args.bucket_mb, threads=args.threads, codecs=codecs, reps=args.reps,
                                network=network, corun=args.corun,
                                guard_steps=GUARD_STEPS if args.guard_steps is None else args.guard_steps,
                                progress=lambda line: print(line, file=sys.stderr, flush=True))
    if network_spec is not None and args.host_speed:  # each host's step speed there, all at once (quota and co-running included)
        import dataclasses

        from thinwire.cluster.emulator import EmulatedCluster
        from thinwire.measure.hostspeed import describe, host_speeds

        rec = host_speeds(EmulatedCluster(network_spec), workload=args.workload, model=model, data=args.data,
                          batch=sizes[0], threads=prof.threads)
        print(f"host speeds on {network_spec.name} (one process alone here = 1): {describe(rec)}", file=sys.stderr,
              flush=True)
        prof = dataclasses.replace(prof, host_speed=rec)
    if network_spec is not None and network_spec.switch is not None and args.corun:  # its aggregator's CPU
        import dataclasses

        from thinwire.measure.aggregator import aggregator_cpu
        from thinwire.measure.file import AggregatorRecord

        agg = aggregator_cpu(len(network_spec.hosts))
        prof = dataclasses.replace(prof, aggregator=AggregatorRecord(
            trainers=agg["trainers"], per_bucket_s=agg["per_bucket_s"], per_value_s=agg["per_value_s"],
            trainer_per_bucket_s=agg["trainer_per_bucket_s"], trainer_per_value_s=agg["trainer_per_value_s"]))
    path = save_profile(prof, args.out)
    _show(prof, path)
    if len(set(sizes)) == 1:
        Console(stderr=True).print(f"[yellow]one batch size measured ({sizes[0]} per rank): `plan` and `simulate` will "
                                   "price every other one in proportion to it. Give two or more with --batch-sizes "
                                   "for a line that holds a cost per step.[/yellow]")
    if warning := busy_warning(foreign.cores, "the profile measured"):
        Console(stderr=True).print(f"[yellow]{warning}[/yellow]")
    return 0


def _cluster(path: str):
    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.spec import load_cluster_spec

    spec = load_cluster_spec(path)
    EmulatedCluster(spec).require_up()
    return spec


def _show(prof, path: Path) -> None:
    console = Console()
    t = Table(title=f"profile of {prof.workload} ({prof.parameters:,} parameters, {prof.threads} thread(s))")
    for col in ("batch/rank", "data+fwd ms", "backward ms", "optimizer ms", "std ms"):
        t.add_column(col, justify="right")
    for c in prof.compute:
        t.add_row(str(c.batch), *(f"{v * 1e3:.2f}" for v in (c.pre_s, c.backward_s, c.post_s, c.std_s)))
    console.print(t)
    console.print(f"buckets: {[b.numel for b in prof.buckets]} values; {prof.flops_per_sample:.3g} FLOP/sample, "
                  f"{prof.achieved_flops / 1e9:.2f} GFLOP/s achieved")
    for name, c in prof.codecs.items():
        g = c.convergence
        guard = "" if g is None else (
            f"; guard: {g.gap_text(2)} vs fp32 over the second half of {g.steps} steps "
            f"({'reaches' if g.reaches else 'does not reach'} fp32's loss, median of {g.orders} data orders), "
            + (f"{g.factor:.2f}x fp32's samples" if g.factor is not None else "worse than fp32 after its first steps"))
        console.print(f"  {name:>12}: encode {c.encode.per_byte_s * 1e9:.3f} ns/B + {c.encode.fixed_s * 1e6:.0f} us, "
                      f"decode {c.decode.per_byte_s * 1e9:.3f} ns/B + {c.decode.fixed_s * 1e6:.0f} us{guard}")
    if prof.aggregator:
        a = prof.aggregator
        console.print(f"the switch's aggregator: {a.per_bucket_s * 1e3:.2f} ms + {a.per_value_s * 1e9:.2f} ns per value of "
                      f"CPU per bucket from {a.trainers} trainers (uncapped)" + (
                          "" if a.trainer_cpu is None else f"; each trainer's own: {a.trainer_cpu[0] * 1e3:.2f} ms + "
                          f"{a.trainer_cpu[1] * 1e9:.2f} ns per value"))
    if prof.corun_speed:
        console.print("n copies of the step at once each run at " +
                      ", ".join(f"{v:.2f} (n={k})" for k, v in prof.corun_speed.items()) +
                      f" of their fair share min(1, {prof.machine.get('cores', '?')}/n) of one copy's speed alone")
    if prof.collective_cpu_s_per_byte:
        console.print(f"an all-reduce's host CPU: {prof.collective_cpu_s_per_byte * 1e9:.2f} ns per byte sent "
                      f"(one core: {8 / prof.collective_cpu_s_per_byte / 1e9:.1f} Gbit/s at most)")
    if prof.network:
        n = prof.network
        console.print(f"network: alpha {n.alpha_s * 1e6:.0f} us, {n.measured_bps / 1e6:.1f} of "
                      f"{n.nominal_bps / 1e6:.1f} Mbit/s ({n.efficiency:.1%})"
                      + (f"; a ring hop issued while the hosts compute waits {n.busy_hop_s * 1e3:.2f} ms for their "
                         "CPU quotas" if n.busy_hop_s else ""))
    console.print(f"wrote {path}")


def default_profile_codecs() -> list[str]:
    """Every codec at its default parameters and every spec that plan, ``auto`` and doctor try by default
    (``powersgd:rank=8``, not the default rank 4): a default profile prices each of their candidates."""
    names = list(REGISTRY.names())
    have = {spec_string(parse_codec_spec(n)) for n in names}
    return names + [c for c in default_candidates() if spec_string(parse_codec_spec(c)) not in have]
