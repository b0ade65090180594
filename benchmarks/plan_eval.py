"""The planner's evaluation on emulated clusters: the plan against uniform DDP fp32, uniform DDP with the
best single codec, and every alternative the planner kept, each trained for the same samples.

    sudo .venv/bin/python benchmarks/plan_eval.py             # (a)-(c), plan + 6 alternatives (~45-60 min on 2 cores)
    sudo .venv/bin/python benchmarks/plan_eval.py --quick     # plan + 2 alternatives, 30 steps (~15-20 min)
    .venv/bin/python benchmarks/plan_eval.py --plan-only      # profile + plans, no training, no root (~1 min)

Steps:

1. ``thinwire profile`` measures the workload once (per-rank batches around the hosts' shares, the
   candidate codecs, one thread): the planner's only input besides the cluster spec.
2. For each cluster, the network is probed on its own hosts and links (``probe_network``, what
   ``thinwire profile --cluster SPEC`` adds: latency, payload rate, the quota wait; ``--no-probe``
   leaves it out, as runs before 2026-12-03 did) into ``profile-<key>.yaml``, and ``thinwire plan
   --colocated CORES`` (the emulated hosts share this machine's cores) writes the plan from it; each alternative it kept becomes a plan file of its own (``Plan.select``).
3. Each contender runs ``thinwire train --cluster SPEC`` for ``--steps`` steps at the same global
   batch: ``torch:none`` (PyTorch DDP fp32, even shares), the planner's best single codec on uniform
   DDP, the plan (``--plan``), and every alternative (``--plan``). From each run's metrics.jsonl: median
   step time (after the first 3 steps) and wall-clock time until the validation loss first reaches
   the target, the final validation loss of DDP fp32 on the same cluster within 0.5%
   (:func:`compare.time_to_target`).
4. The acceptance checks of issue 6: the plan is >= 1.3x faster per step than DDP fp32, not slower
   than uniform DDP with the best single codec, within 10% of the best measured candidate.

Writes ``benchmarks/results/plan_eval.json``, ``plan_eval.md`` and the plans under
``benchmarks/results/plan_eval/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import MODEL, summarize, time_to_target  # noqa: E402

CLUSTERS = {"a": "plan-a-slow-cpu", "b": "plan-b-two-groups", "c": "plan-c-slow-link"}
CODECS = "none,bf16,bfp,int8,powersgd:rank=4,topk:ratio=0.01"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def thinwire(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout)


def model_sets() -> list[str]:
    return [a for k, v in MODEL.items() for a in ("--set", f"model.{k}={v}")]


def make_profile(folder: Path, batch: int) -> Path:
    path = folder / "profile.yaml"
    sizes = sorted({max(1, batch // d) for d in (2, 4, 8, 16)}, reverse=True)
    proc = thinwire("profile", "--workload", "charlm", *[f"--set=model.{k}={v}" for k, v in MODEL.items()],
                    "--batch-sizes", ",".join(map(str, sizes)), "--codecs", CODECS, "--threads", "1",
                    "--out", str(path))
    if proc.returncode != 0:
        raise SystemExit(f"profile failed: {proc.stderr[-2000:]}")
    return path


def make_plans(key: str, spec: Path, profile: Path, batch: int, keep: int, folder: Path) -> tuple[Path, list[Path]]:
    """The plan file and one plan file per alternative it kept."""
    from thinwire.plan.planfile import read_plan, save_plan

    out = folder / f"plan-{key}.yaml"
    proc = thinwire("plan", "--cluster", str(spec), "--workload", "charlm", *model_sets(), "--profile", str(profile),
                    "--batch-size", str(batch), "--codecs", CODECS, "--colocated", str(os.cpu_count() or 2),
                    "--eval-every", "0",  # per-step comparison: validation is not what is measured here
                    "--keep", str(keep), "--out", str(out))
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"plan for {spec} failed: {proc.stderr[-2000:]}")
    plan = read_plan(out)
    return out, [save_plan(plan.select(i), folder / f"plan-{key}-alt{i + 1}.yaml") for i in range(len(plan.alternatives))]


def run_one(spec: Path, label: str, how: list[str], out: Path, steps: int, batch: int) -> dict:
    args = ["train", "--cluster", str(spec), "--workload", "charlm", "--steps", str(steps), "--batch-size", str(batch),
            "--threads", "1", "--eval-every", str(max(1, steps // 10)), "--checkpoint-every", str(steps),
            "--set", "warmup_steps=10", "--out", str(out), *model_sets(), *how]
    t0 = time.time()
    proc = thinwire(*args)
    if proc.returncode != 0:
        return {"contender": label, "error": (proc.stderr or proc.stdout)[-1500:], "elapsed_s": time.time() - t0}
    from thinwire.train.metrics import read_metrics

    return summarize(label, read_metrics(out), time.time() - t0)


def contenders(plan_path: Path, alts: list[Path]) -> list[tuple[str, list[str], float | None, str]]:
    """(label, train flags, predicted step s, plan name) of every run on one cluster."""
    from thinwire.plan.planfile import read_plan

    plan = read_plan(plan_path)
    out = [("DDP fp32 (torch:none)", ["--compression", "torch:none"], plan.baselines["uniform_ddp_fp32_s"], "")]
    best = plan.baselines["best_single_codec"]
    if best != "none":
        out.append((f"uniform DDP, {best}", ["--compression", str(best)], plan.baselines["best_single_codec_s"], ""))
    out.append(("plan", ["--plan", str(plan_path)], plan.chosen.predicted_step_s, plan.chosen.name))
    for i, path in enumerate(alts):
        alt = read_plan(path).chosen
        out.append((f"alternative {i + 1}", ["--plan", str(path)], alt.predicted_step_s, alt.name))
    return out


def probed_profile(profile: Path, cluster, out: Path) -> Path:
    """``profile`` with the network measured on ``cluster``'s own hosts and links (what ``thinwire profile
    --cluster SPEC`` adds: latency, payload rate, the quota wait), without measuring the workload again."""
    import dataclasses

    from thinwire.measure.file import load_profile, save_profile
    from thinwire.measure.network import probe_network

    net = probe_network(cluster.spec)
    print(f"[{cluster.spec.name}] network: alpha {net.alpha_s * 1e3:.2f} ms per message, {net.measured_bps / 1e6:.0f} "
          f"Mbit/s payload, quota wait {(net.busy_hop_s or 0) * 1e3:.2f} ms per hop", flush=True)
    return save_profile(dataclasses.replace(load_profile(profile), network=net), out)


def bench_cluster(key: str, profile: Path, args, folder: Path, work: Path) -> dict:
    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.spec import load_cluster_spec

    spec = ROOT / "examples" / "clusters" / f"{CLUSTERS[key]}.yaml"
    runs = []
    cluster = EmulatedCluster(load_cluster_spec(spec))
    cluster.up()
    try:
        if not args.no_probe:
            profile = probed_profile(profile, cluster, folder / f"profile-{key}.yaml")
        plan_path, alts = make_plans(key, spec, profile, args.batch, args.keep, folder)
        for label, how, predicted, name in contenders(plan_path, alts):
            print(f"[{CLUSTERS[key]}] {label}: {name or ' '.join(how)} ...", flush=True)
            r = run_one(spec, label, how, work / f"{key}-{label.replace(' ', '_').replace(',', '')}", args.steps,
                        args.batch)
            r.update(predicted_step_s=predicted, plan_name=name, flags=how)
            runs.append(r)
            print(f"    {r['median_step_s'] * 1e3:.0f} ms/step (predicted {predicted * 1e3:.0f})" if "error" not in r
                  else f"    FAILED: {r['error'][-300:]}", flush=True)
    finally:
        cluster.down()
    return {"cluster": CLUSTERS[key], "plan": str(plan_path.relative_to(ROOT) if plan_path.is_relative_to(ROOT) else plan_path), "runs": runs, **checks(runs)}


def checks(runs: list[dict]) -> dict:
    ok = {r["contender"]: r for r in runs if "error" not in r}
    base = ok.get("DDP fp32 (torch:none)")
    target = base["final_val_loss"] if base else None
    for r in runs:
        r["time_to_target_s"] = time_to_target(r, target) if target is not None and "error" not in r else None
    plan = ok.get("plan")
    if not plan or not base:
        return {"target_val_loss": target, "checks": {"error": "the plan or DDP fp32 run failed"}}
    single = next((r for k, r in ok.items() if k.startswith("uniform DDP,")), base)
    best = min(ok.values(), key=lambda r: r["median_step_s"])
    return {"target_val_loss": target, "checks": {
        "speedup_vs_ddp_fp32": base["median_step_s"] / plan["median_step_s"],
        "speedup_vs_best_single_codec": single["median_step_s"] / plan["median_step_s"],
        "best_measured": best["contender"], "plan_vs_best_measured": plan["median_step_s"] / best["median_step_s"],
        "pass_1.3x_ddp_fp32": base["median_step_s"] / plan["median_step_s"] >= 1.3,
        "pass_not_slower_than_best_single_codec": plan["median_step_s"] <= single["median_step_s"],
        "pass_within_10pct_of_best": plan["median_step_s"] <= 1.1 * best["median_step_s"]}}


def markdown(results: dict) -> str:
    lines = ["# Planner evaluation on emulated clusters\n", f"Command: `{results['command']}`  ",
             f"Workload: charlm {MODEL}, global batch {results['batch']}, {results['steps']} steps for every contender "
             "(equal samples), gloo over tc-shaped links, hosts capped by cgroups on one 2-core machine. "
             "Target: the final validation loss of DDP fp32 on the same cluster (reached = within 0.5%).\n"]
    for c in results["clusters"]:
        lines += [f"\n## {c['cluster']} (plan: `{c['plan']}`)\n",
                  "| contender | plan | predicted ms | measured ms | vs DDP fp32 | val loss | time to target (s) |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        base = next((r for r in c["runs"] if r["contender"].startswith("DDP fp32") and "error" not in r), None)
        for r in c["runs"]:
            if "error" in r:
                lines.append(f"| {r['contender']} | failed: {r['error'].splitlines()[-1][:80] if r['error'] else ''} |||||| ")
                continue
            ttt = r["time_to_target_s"]
            lines.append(f"| {r['contender']} | {r['plan_name'] or ' '.join(r['flags'])} | "
                         f"{r['predicted_step_s'] * 1e3:.0f} | {r['median_step_s'] * 1e3:.0f} | "
                         f"{base['median_step_s'] / r['median_step_s']:.2f}x | {r['final_val_loss']:.4f} | "
                         f"{'not reached' if ttt is None else f'{ttt:.1f}'} |" if base else "")
        lines.append("\nChecks: " + ", ".join(f"{k} = {v:.3g}" if isinstance(v, float) else f"{k} = {v}"
                                              for k, v in c["checks"].items()))
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="plan + 2 alternatives, 30 steps")
    ap.add_argument("--steps", type=int, help="steps per run (default 60, 30 with --quick)")
    ap.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    ap.add_argument("--keep", type=int, help="alternatives per plan to measure (default 6, 2 with --quick)")
    ap.add_argument("--clusters", default="a,b,c", help="comma-separated subset of a,b,c")
    ap.add_argument("--plan-only", action="store_true", help="profile and plan, print the plans, train nothing")
    ap.add_argument("--no-probe", action="store_true", help="plan every cluster from the workload's profile alone "
                    "(no network probe on the cluster: the runs before 2026-12-03)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    args.steps = args.steps or (30 if args.quick else 60)
    args.keep = args.keep or (2 if args.quick else 6)
    keys = [k.strip() for k in args.clusters.split(",") if k.strip()]
    if any(k not in CLUSTERS for k in keys):
        ap.error(f"--clusters takes a subset of {','.join(CLUSTERS)}, got {args.clusters!r}")
    if not args.plan_only and os.geteuid() != 0:
        print("plan_eval.py needs root for the emulated cluster (network namespaces, tc, cgroups). Run it with sudo, "
              "or use --plan-only.")
        return 2
    folder = Path(args.out) / "plan_eval"
    folder.mkdir(parents=True, exist_ok=True)
    results = {"command": "sudo .venv/bin/python benchmarks/plan_eval.py " + " ".join(sys.argv[1:]),
               "steps": args.steps, "batch": args.batch, "model": MODEL, "clusters": []}
    t0 = time.time()
    profile = make_profile(folder, args.batch)
    if args.plan_only:
        for k in keys:
            make_plans(k, ROOT / "examples" / "clusters" / f"{CLUSTERS[k]}.yaml", profile, args.batch, args.keep, folder)
        return 0
    with tempfile.TemporaryDirectory(prefix="thinwire-plan-eval-") as tmp:
        for k in keys:
            results["clusters"].append(bench_cluster(k, profile, args, folder, Path(tmp)))
    results["elapsed_s"] = time.time() - t0
    out = Path(args.out)
    (out / "plan_eval.json").write_text(json.dumps(results, indent=1))
    (out / "plan_eval.md").write_text(markdown(results) + f"\nTotal time: {results['elapsed_s'] / 60:.1f} min\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
