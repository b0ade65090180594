"""``thinwire doctor``: in about a minute, what share of this job's step is communication, what each
codec and sync mode is predicted to gain, and one recommendation with the command to run it."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from thinwire.cli.common import COMMANDS, add_workload_args
from thinwire.config import check_writable
from thinwire.errors import ThinwireError
from thinwire.measure.file import gap_text
from thinwire.measure.foreign import ForeignCpu, busy_warning

EPILOG = """examples:
  thinwire doctor --nproc 2                                   # charlm on 2 local workers
  thinwire doctor --workload mypkg.jobs:build --nproc 4 --json
  thinwire doctor --cluster examples/clusters/pair-100mbit.yaml   # on the emulated cluster (root)
  thinwire doctor --guard profile.yaml                        # recommend only what reaches fp32's loss
  torchrun --nnodes 4 --nproc-per-node 1 ... -m thinwire doctor    # on your own nodes
"""


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help=COMMANDS["doctor"],
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--batch-size", type=int, help="global batch (default: the workload's)")
    p.add_argument("--nproc", type=int, help="local worker processes (default 2; with --cluster, one per host)")
    p.add_argument("--cluster", help="an emulated cluster spec: one worker per host (needs `thinwire cluster up`)")
    p.add_argument("--threads", type=int, help="torch threads per worker (default: cores / local workers)")
    p.add_argument("--out", help="folder for report.json (default: runs/doctor-TIMESTAMP; must not exist)")
    p.add_argument("--guard", metavar="PROFILE", help="a `thinwire profile` of this workload: recommend only codecs its "
                   "convergence guard says reach fp32's loss, ranked by time to it (as `plan` and `auto:guard=` do)")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from thinwire.doctor.worker import REPORT, diagnose
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.train.config import load_train_config, save_config
    from thinwire.train.distenv import read_env
    from thinwire.workloads.registry import build_workload, check_workload_name

    if args.cluster is None and args.nproc is None:
        args.nproc = 2
    overrides = {"workload": args.workload, "data": args.data, "batch_size": args.batch_size, "nproc": args.nproc,
                 "cluster": args.cluster, "threads": args.threads, "out": args.out}
    cfg = load_train_config(None, {k: v for k, v in overrides.items() if v is not None}, args.set)
    check_workload_name(cfg.workload)
    if cfg.nproc < 1:
        raise ThinwireError(f"nproc: must be at least 1, got {cfg.nproc}")
    env = read_env()
    out = Path(cfg.out or Path("runs") / f"doctor-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    check_writable(out, "out", folder=True)
    # a folder of doctor's own files without its report (a doctor stopped before it finished) is taken over
    # (hosts/: the emulated hosts' logs of a `doctor --cluster`)
    unfinished = out.is_dir() and {p.name for p in out.iterdir()} <= {"config.yaml", "profile.yaml", "hosts"}
    if out.exists() and any(out.iterdir()) and not unfinished and not env.launched:
        raise ThinwireError(f"out: {str(out)!r} exists and is not empty; doctor never writes over a folder. "
                            "Pass a new --out.")
    wl = build_workload(cfg.workload, cfg.model, cfg.data)  # a bad workload or data path fails here, before launch
    guard = _guard_records(args.guard, cfg) if args.guard else None
    if not env.launched:
        from thinwire.train.loop import check_batch

        hosts = len(load_cluster_spec(cfg.cluster).hosts) if cfg.cluster else cfg.nproc
        check_batch(cfg.batch_size or wl.batch_size, hosts)
    out.mkdir(parents=True, exist_ok=True)
    import dataclasses

    cfg = dataclasses.replace(cfg, out=str(out))
    if env.launched:  # under the user's torchrun: this process is one of the ranks
        report = diagnose(cfg, out)
        if report is not None:
            show(_guarded(report, guard, args.guard, out), as_json=args.json)
        return 0
    save_config(cfg, out / "config.yaml")
    with ForeignCpu() as foreign:  # other processes' CPU while the trials ran: they move every timing doctor compares
        if cfg.cluster:
            from thinwire.train.cluster_launch import launch_cluster

            # with a `switch:` in the spec its aggregator runs too, and int8 is tried through it
            launch_cluster(cfg, out / "config.yaml", module="thinwire.doctor.worker",
                           aggregator=load_cluster_spec(cfg.cluster).switch is not None)
        else:
            from thinwire.train.launch import launch_local

            launch_local(cfg, out / "config.yaml", module="thinwire.doctor.worker")
    path = out / REPORT
    if not path.is_file():
        raise ThinwireError(f"doctor: the workers finished without writing {path}; see their output above")
    show(_guarded(json.loads(path.read_text()), guard, args.guard, out), as_json=args.json)
    if warning := busy_warning(foreign.cores, "doctor measured (its advice may change from run to run)"):
        Console(stderr=True).print(f"[yellow]{warning}[/yellow]")
    return 0


def _guard_records(path: str, cfg) -> dict:
    """The convergence guard's records of ``--guard``'s profile, checked against this job's workload."""
    from thinwire.measure.file import load_profile

    from thinwire.plan.planfile import normalized_model

    prof = load_profile(path, flag=None)  # --guard: a guarded profile is made, not measured here
    if prof.workload != cfg.workload or (normalized_model(cfg.workload, prof.model)
                                         != normalized_model(cfg.workload, cfg.model)):
        raise ThinwireError(f"--guard: {path!r} profiles workload {prof.workload!r} with model options {prof.model}, "
                            f"but doctor runs {cfg.workload!r} with {dict(cfg.model)}; profile this workload "
                            "(`thinwire profile --workload ...`) and pass that file.")
    if not prof.guarded:
        raise ThinwireError(f"--guard: {path!r} has no convergence guard records (it was made with --guard-steps 0); "
                            "run `thinwire profile` again without --guard-steps 0.")
    return {c: v.convergence for c, v in prof.codecs.items() if v.convergence is not None}


def _guarded(report: dict, guard: dict | None, source: str | None, out: Path) -> dict:
    """The report with the guard applied (and written back to report.json), or as it is without one."""
    if guard is None:
        return report
    from thinwire.doctor.advise import apply_guard
    from thinwire.doctor.worker import REPORT

    report = apply_guard(report, guard, source)
    (out / REPORT).write_text(json.dumps(report, indent=1))
    return report


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def show(r: dict, *, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(r, indent=1))
        return
    con = Console()
    m = r["measured"]
    ar = m["allreduce"]
    con.print(f"[bold]thinwire doctor[/]: {r['workload']} on {r['world_size']} rank(s), {r['per_rank_batch']} samples per "
              f"rank, measured in {r['elapsed_s']:.0f} s")
    con.print(f"step with DDP fp32 {_ms(m['ddp_fp32_step_s'])}; without communication {_ms(m['no_comm_step_s'])} "
              f"(slowest rank): communication is [bold]{m['comm_share']:.0%}[/] of the step")
    (small, large), (t_small, t_large) = ar.get("sizes") or (0, 0), ar.get("times_s") or (0.0, 0.0)
    if ar.get("bus_bps") and t_large < 1.5 * t_small:  # the fit's bandwidth is noise: the wire did not show
        con.print(f"all-reduce: {ar['alpha_s'] * 1e6:.0f} us latency; at this model's size the bandwidth does not "
                  f"show ({large / 1024:.0f} KiB took {t_large * 1e3:.2f} ms, {small / 1024:.0f} KiB {t_small * 1e3:.2f} "
                  f"ms); the model predicts DDP fp32 at {_ms(r['model']['ddp_fp32_step_s'])} "
                  f"({r['model']['error_vs_measured']:+.0%} against measured)")
    elif ar.get("bus_bps"):
        con.print(f"all-reduce: {ar['bus_bps'] / 1e6:.0f} Mbit/s bus bandwidth, {ar['alpha_s'] * 1e6:.0f} us latency; "
                  f"the model predicts DDP fp32 at {_ms(r['model']['ddp_fp32_step_s'])} "
                  f"({r['model']['error_vs_measured']:+.0%} against measured); the "
                  f"{r['model']['unexplained_comm_s'] * 1e3:+.1f} ms it does not explain are charged to every codec "
                  "by its bytes")
    for h in r["slow_hosts"]:
        con.print(f"rank {h['rank']} computes {h['x_median']:.2f}x slower than the median rank: `thinwire plan` can give "
                  "it a smaller share")
    for q in r["slow_links"]:
        con.print(f"link rank {q['a']} <-> rank {q['b']}: {q['bps'] / 1e6:.0f} Mbit/s, under half the median pair's")
    guarded = bool(r.get("guard"))
    tried = any(c["source"] == "trial" for c in r["codecs"])  # none's trial is fp32 through thinwire's hook, not DDP's
    how = (", tried for a few steps each through thinwire's hook (none: fp32 through it, the speed-ups' base)"
           if tried else ", priced by the model")
    loss = f"; loss by the convergence guard of {r['guard']}" if guarded else " (loss at equal samples not measured here)"
    t = Table(title="codecs" + how + loss)
    for col in ("codec", "step", "speed-up", "model's", "MB per rank", *(("guard", "to fp32's loss") if guarded else ())):
        t.add_column(col, justify="right" if col != "codec" else "left")
    for c in r["codecs"]:
        g = c.get("guard")
        verdict = () if not guarded else (
            ("no record", "-") if g is None else
            (f"{gap_text(g['gap'])}, {g['factor']:.2f}x samples" if g["reaches"]
             else f"does not reach ({gap_text(g['gap'])})",
             "-" if c["time_speedup"] is None else f"{c['time_speedup']:.2f}x"))
        t.add_row(c["codec"], _ms(c["predicted_step_s"]), f"{c['speedup']:.2f}x" + ("" if c["source"] == "trial" else " (model)"),
                  f"{c['model_speedup']:.2f}x", f"{c['bytes_per_rank'] / 1e6:.2f}", *verdict)
    con.print(t)
    s = Table(title="sync modes (what-if: their loss at equal samples is not predicted)")
    for col in ("sync", "codec", "step", "speed-up"):
        s.add_column(col, justify="right" if col not in ("sync", "codec") else "left")
    for m_ in r["sync_modes"]:
        s.add_row(m_["sync"], m_["codec"], _ms(m_["predicted_step_s"]), f"{m_['speedup']:.2f}x")
    con.print(s)
    rec = r["recommendation"]
    con.print(f"[bold]recommendation[/]: {rec['why'].rstrip('.')}.")
    if rec.get("command"):
        con.print(f"  run: {rec['command']}" + (f"\n  or in your DDP script: {rec['in_your_script']}"
                                                 if rec.get("in_your_script") else ""))
