"""Does the plan keep its promise in time to target? Issue 27's done-when: on 3 heterogeneous emulated clusters
and 3 workloads (charlm, digits and ``benchmarks/workloads/denoise.py``, which is neither), 3 seeds, the plan's
measured time to DDP fp32's final loss is within 10% of the best of its kept alternatives in at least 8 of 9
cells, and never more than 25% behind.

    sudo .venv/bin/python benchmarks/plan_target.py --workloads digits          # one workload, 3 clusters x 3 seeds
    sudo .venv/bin/python benchmarks/plan_target.py --workloads denoise         # later parts add to the same JSON
    .venv/bin/python benchmarks/plan_target.py --rerender                       # .md and .png from the .json

For each workload (the settings of ``guard_eval.py``: each workload's default learning rate, its global batch
and steps N):

1. ``thinwire profile`` with the convergence guard (the planner's only input besides the cluster spec);
2. for each cluster of ``plan_eval.py`` (a: a 1/8-core host among half-core ones; b: two groups joined by a
   thin link; c: one host behind a slow link), ``thinwire plan --keep K`` ranks by predicted time to DDP fp32's
   loss (step x the guard's sample factor) and keeps K alternatives;
3. the target, per seed: DDP fp32's final validation loss after N steps on 4 local workers (losses at equal
   samples do not depend on the link or on how the global batch is split: ``compare.md``'s numerics check);
4. seed by seed, the plan and each alternative (in an order rotated per seed) train on the emulated cluster for
   ``--steps-factor`` x N steps (a lossy plan may need more samples than fp32), validating every N/20 steps;
   time to target = wall-clock seconds of training, validations included, until the validation loss is within
   0.5% of the target (``compare.time_to_target``; a run that never gets there counts as never). The plans are
   made with the same validation cadence (``--eval-every``, ``--eval-batches``): the planner prices it.

A cell (workload, cluster) compares the plan's median time to target over seeds with the best median among
its alternatives. Every run is saved to the JSON as it ends; a second call skips what is there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare import summarize, time_to_target  # noqa: E402
from guard_eval import WORKLOADS, sets, write_json  # noqa: E402
from plan_eval import CLUSTERS, CODECS  # noqa: E402

def rel(p: Path) -> str:
    """A path as the JSON keeps it: repo-relative where it can be."""
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
WITHIN, NEVER_MORE = 0.10, 0.25   # the done-when's bars


def thinwire(*args: str, timeout: float = 3600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=ROOT)


def must(proc: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    return proc


EVAL_BATCHES = 50  # each validation's global batches: enough for a 0.5% target to be read off the curve


def eval_every(n: int) -> int:
    """Steps between validations of a workload trained N steps: 20 points on the target run's curve."""
    return max(1, n // 20)


def common(name: str, steps: int, seed: int, out: Path) -> list[str]:
    workload, model, batch, n = WORKLOADS[name]
    return ["--workload", workload, *sets(model), "--steps", str(steps), "--batch-size", str(batch), "--threads", "1",
            "--eval-every", str(eval_every(n)), "--checkpoint-every", str(steps), "--set", f"eval_batches={EVAL_BATCHES}",
            "--seed", str(seed), "--out", str(out)]


def make_profile(name: str, folder: Path) -> Path:
    workload, model, batch, _ = WORKLOADS[name]
    path = folder / f"profile-{name}.yaml"
    sizes = sorted({max(1, batch // d) for d in (1, 2, 4, 8, 16)}, reverse=True)
    must(thinwire("profile", "--workload", workload, *sets(model), "--batch-sizes", ",".join(map(str, sizes)),
                  "--codecs", CODECS, "--threads", "1", "--out", str(path)), f"profile of {name}")
    return path


def reguard(name: str, profile: Path) -> None:
    """Replace the convergence records of the stored ``profile`` by this commit's guard (what ``thinwire
    profile`` now records: the same codecs, its largest batch as the global batch, seed 0), nothing else."""
    import torch

    from thinwire.measure.convergence import GUARD_STEPS, GUARD_WORLD, measure_convergence
    from thinwire.measure.file import load_profile, save_profile
    from thinwire.workloads.registry import build_workload

    workload, model, _, _ = WORKLOADS[name]
    prof = load_profile(profile)
    codecs = [c for c, v in prof.codecs.items() if v.convergence is not None]
    b0 = max(c.batch for c in prof.compute)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    guard = measure_convergence(build_workload(workload, dict(model), None), codecs, world=min(GUARD_WORLD, b0),
                                batch=b0, steps=GUARD_STEPS, seed=0, delayed=True,
                                progress=lambda line: print(f"{name}: {line}", flush=True))
    for c in codecs:
        prof.codecs[c].convergence = guard[c]
    if "delayed" in guard:
        prof.sync["delayed"] = guard["delayed"]
    save_profile(prof, profile)


def record_val_items(name: str, profile: Path) -> bool:
    """Add the validation set's size to a stored profile made before ``thinwire profile`` recorded it
    (``val_items``: what the planner prices a validation from); True if it was added."""
    from thinwire.measure.file import load_profile, save_profile
    from thinwire.workloads.registry import build_workload

    prof = load_profile(profile)
    if prof.val_items:
        return False
    workload, model, _, _ = WORKLOADS[name]
    prof.val_items = len(build_workload(workload, dict(model), None).val)
    save_profile(prof, profile)
    return True


def make_plans(name: str, key: str, profile: Path, keep: int, folder: Path) -> list[dict]:
    """[{label, path, name, predicted_step_s, sample_factor}] of the plan and each alternative it kept."""
    from thinwire.plan.planfile import read_plan, save_plan

    workload, model, batch, n = WORKLOADS[name]
    spec = ROOT / "examples" / "clusters" / f"{CLUSTERS[key]}.yaml"
    out = folder / f"plan-{name}-{key}.yaml"
    proc = must(thinwire("plan", "--cluster", str(spec), "--workload", workload, *sets(model), "--profile", str(profile),
                         "--batch-size", str(batch), "--codecs", CODECS, "--colocated", str(os.cpu_count() or 2),
                         "--eval-every", str(eval_every(n)), "--eval-batches", str(EVAL_BATCHES),
                         "--keep", str(keep), "--out", str(out)), f"plan of {name} on {key}")
    print(proc.stdout, flush=True)
    plan = read_plan(out)
    paths = [out] + [save_plan(plan.select(i), folder / f"plan-{name}-{key}-alt{i + 1}.yaml")
                     for i in range(len(plan.alternatives))]
    rows = []
    for i, p in enumerate(paths):
        c = read_plan(p).chosen
        rows.append({"label": "plan" if i == 0 else f"alternative {i}", "path": rel(p),
                     "name": c.name, "predicted_step_s": c.predicted_step_s, "sample_factor": c.sample_factor})
    return rows


def target(name: str, seed: int, work: Path) -> float:
    _, _, _, n = WORKLOADS[name]
    out = work / f"target-{name}-s{seed}"
    must(thinwire("train", *common(name, n, seed, out), "--compression", "none", "--nproc", "4"),
         f"DDP fp32 target run of {name}, seed {seed}")
    return json.loads((out / "summary.json").read_text())["val_loss"]


def run(name: str, key: str, contender: dict, seed: int, steps: int, work: Path) -> dict:
    from thinwire.train.metrics import read_metrics

    spec = ROOT / "examples" / "clusters" / f"{CLUSTERS[key]}.yaml"
    out = work / f"{name}-{key}-{contender['label'].replace(' ', '_')}-s{seed}"
    t0 = time.time()
    proc = thinwire("train", *common(name, steps, seed, out), "--cluster", str(spec), "--plan", str(ROOT / contender["path"]))
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-1500:], "elapsed_s": time.time() - t0}
    r = summarize(contender["label"], read_metrics(out), time.time() - t0)
    return {k: r[k] for k in ("median_step_s", "mean_step_s", "compute_s", "comm_wait_s", "final_val_loss",
                              "val_curve", "elapsed_s")}


def cell(data: dict, name: str, key: str) -> dict | None:
    w = data["workloads"].get(name, {})
    c = w.get("clusters", {}).get(key)
    if not c:
        return None
    medians = {}
    for con in c["contenders"]:
        times = []
        for s in data["seeds"]:
            r, tgt = c["runs"].get(f"{con['label']}@{s}"), w.get("targets", {}).get(str(s))
            if r is None or tgt is None:
                continue
            t = None if "error" in r else time_to_target(r, tgt)
            times.append(math.inf if t is None else t)
        if times:
            medians[con["label"]] = statistics.median(times)
    plan = medians.get("plan")
    alts = [v for k, v in medians.items() if k != "plan"]
    if plan is None or not alts:
        return {"medians": medians, "done": False}
    best = min(alts)
    ratio = plan / best if math.isfinite(best) and best > 0 else (1.0 if plan == best else 0.0 if math.isfinite(plan) else math.inf)
    return {"medians": medians, "ratio": ratio, "within": ratio <= 1 + WITHIN, "never_more": ratio <= 1 + NEVER_MORE,
            "done": all(len([s for s in data["seeds"] if f"{con['label']}@{s}" in c["runs"]]) == len(data["seeds"])
                        for con in c["contenders"])}


def render(data: dict, out: Path) -> None:
    fmt = lambda t: "never" if t is None or not math.isfinite(t) else f"{t:.1f}"  # noqa: E731
    cells = [(n, k, cell(data, n, k)) for n in WORKLOADS for k in CLUSTERS]
    cells = [(n, k, c) for n, k, c in cells if c and "ratio" in c]
    within = sum(c["within"] for _, _, c in cells)
    lines = ["# Plans in time to DDP fp32's loss: the plan against its kept alternatives (issue 27)", "",
             f"Commands: {'; '.join(f'`{c}`' for c in data['commands'])}  ",
             f"Runs {data['started']} to {data['ended']} UTC (commits {', '.join(data['commits'])}). Seeds "
             f"{', '.join(map(str, data['seeds']))}, seed by seed, contenders rotated per seed. Each workload at its "
             "default learning rate, global batch and steps N; contenders train "
             f"{data['steps_factor']} x N steps on the emulated cluster; the target per seed is DDP fp32's final loss "
             "after N steps on 4 local workers; time to target = wall-clock seconds of training, validations included, "
             "until the validation loss is within 0.5% of it (50 global batches or the whole set every N/20 steps). "
             "Plans from `thinwire plan --keep K --eval-every N/20 --eval-batches 50` with the guard's sample factors "
             "in the profile.", "",
             *([f"Cells planned again after a planner change ({', '.join(sorted({k.split('@')[1] for w in data['workloads'].values() for k in w.get('superseded', {})}))}: "
                "a codec the guard says does not reach fp32's loss is left out, as `auto` leaves it out; the guard's "
                "three data orders; a validation's time, split over the plan's hosts, counted in the time to target) "
                "were measured again; their earlier runs are under `superseded` in the JSON, the earlier tables are "
                "`archive/plan_target_v1.md` and `v2`, `v3`.", ""] if any(w.get("superseded") for w in data["workloads"].values()) else []),
             f"**The plan is within 10% of the best of its alternatives in {within} of {len(cells)} cells "
             f"and at most 25% behind in {sum(c['never_more'] for _, _, c in cells)} of {len(cells)}** "
             "(issue 27 asks for at least 8 of 9 within 10%, all within 25%).", "",
             "| workload | cluster | plan / best alternative | plan median (s) | best alternative median (s) | cell complete |",
             "|---|---|---:|---:|---:|---|"]
    for n, k, c in cells:
        alts = {l: v for l, v in c["medians"].items() if l != "plan"}
        ratio = "0 (no alternative gets there)" if c["ratio"] == 0 else "inf (the plan never gets there)" \
            if math.isinf(c["ratio"]) else f"{c['ratio']:.2f}"
        lines.append(f"| {n} | {CLUSTERS[k]} | {ratio} | {fmt(c['medians']['plan'])} | {fmt(min(alts.values()))} | "
                     f"{'yes' if c['done'] else 'partial'} |")
    for n, w in data["workloads"].items():
        lines += ["", f"## {n}", "", "Targets (DDP fp32, N steps, by seed): "
                  + ", ".join(f"seed {s}: {v:.5g}" for s, v in sorted(w.get("targets", {}).items())) + "."]
        for k, c in w.get("clusters", {}).items():
            lines += ["", f"### {CLUSTERS[k]}", "",
                      "| contender | decision | predicted ms | samples x (guard) | median step ms (per seed) | final val loss (per seed) | time to target s (per seed) | median s |",
                      "|---|---|---:|---:|---|---|---|---:|"]
            med = (cell(data, n, k) or {}).get("medians", {})
            for con in c["contenders"]:
                rs = [c["runs"].get(f"{con['label']}@{s}") for s in data["seeds"]]
                tg = [w.get("targets", {}).get(str(s)) for s in data["seeds"]]
                step = ", ".join("-" if r is None else "failed" if "error" in r else f"{1e3 * r['median_step_s']:.0f}" for r in rs)
                loss = ", ".join("-" if r is None or "error" in r else f"{r['final_val_loss']:.4g}" for r in rs)
                ttt = ", ".join("-" if r is None or t is None else fmt(None if "error" in r else time_to_target(r, t))
                                for r, t in zip(rs, tg))
                lines.append(f"| {con['label']} | {con['name']} | {1e3 * con['predicted_step_s']:.0f} | "
                             f"{con['sample_factor']:.2f} | {step} | {loss} | {ttt} | "
                             f"{fmt(med[con['label']]) if con['label'] in med else '-'} |")
    (out / "plan_target.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--clusters", default=",".join(CLUSTERS), help=f"comma-separated subset of {','.join(CLUSTERS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--keep", type=int, default=2, help="alternatives per plan (default 2)")
    ap.add_argument("--steps-factor", type=float, default=1.5, help="contenders train this many times N steps")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rerender", action="store_true")
    ap.add_argument("--replan", action="store_true",
                    help="plan the selected cells again (after a planner change); a cell whose plan or alternatives "
                         "changed loses its runs (kept under 'superseded' in the JSON) and is measured again")
    ap.add_argument("--reguard", action="store_true",
                    help="run the convergence guard again (this commit's rule) into each selected workload's stored "
                         "profile, then --replan")
    args = ap.parse_args()
    args.replan = args.replan or args.reguard
    out = Path(args.out)
    path = out / "plan_target.json"
    data = json.loads(path.read_text()) if path.exists() else {"workloads": {}, "commands": [], "commits": []}
    if args.rerender:
        render(data, out)
        return 0
    if os.geteuid() != 0:
        print("plan_target.py needs root for the emulated cluster (network namespaces, tc, cgroups). Run it with sudo.")
        return 2
    names, keys = args.workloads.split(","), args.clusters.split(",")
    if any(n not in WORKLOADS for n in names) or any(k not in CLUSTERS for k in keys):
        ap.error(f"--workloads takes a subset of {','.join(WORKLOADS)}, --clusters of {','.join(CLUSTERS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    data["commands"].append("sudo .venv/bin/python benchmarks/plan_target.py " + " ".join(sys.argv[1:]))
    data["commits"] = sorted(set(data["commits"]) | {commit})
    data["seeds"] = sorted(set(data.get("seeds", [])) | set(seeds))
    data.setdefault("steps_factor", args.steps_factor)
    data.setdefault("started", time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    folder = out / "plan_target"
    folder.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        write_json(path, data)
        render(data, out)

    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.spec import load_cluster_spec

    with tempfile.TemporaryDirectory(prefix="plan_target-") as tmp:
        work = Path(tmp)
        for name in names:
            w = data["workloads"].setdefault(name, {"clusters": {}, "targets": {}})
            if "profile" not in w:
                w["profile"] = rel(make_profile(name, folder))
                save()
            elif args.reguard and w.get("guard_commit") != commit:
                t0 = time.time()
                reguard(name, ROOT / w["profile"])
                w["guard_commit"] = commit
                print(f"{name}: guard run again into {w['profile']} in {time.time() - t0:.0f} s", flush=True)
                save()
            if record_val_items(name, ROOT / w["profile"]):
                print(f"{name}: the validation set's size recorded into {w['profile']}", flush=True)
            for key in keys:
                if args.replan and key in w["clusters"]:
                    c = w["clusters"][key]
                    fresh = make_plans(name, key, ROOT / w["profile"], len(c["contenders"]) - 1, folder)
                    if [x["name"] for x in fresh] != [x["name"] for x in c["contenders"]]:
                        w.setdefault("superseded", {})[f"{key}@{commit}"] = c
                        w["clusters"][key] = {"contenders": fresh, "runs": {}}
                        print(f"{name} {CLUSTERS[key]}: planned anew, contenders changed; measured again", flush=True)
                    save()
                if key not in w["clusters"]:
                    w["clusters"][key] = {"contenders": make_plans(name, key, ROOT / w["profile"], args.keep, folder),
                                          "runs": {}}
                    save()
            for s in seeds:
                if str(s) not in w["targets"]:
                    w["targets"][str(s)] = target(name, s, work)
                    print(f"{name} seed {s}: target {w['targets'][str(s)]:.5g}", flush=True)
                    save()
            steps = math.ceil(data["steps_factor"] * WORKLOADS[name][3])
            for key in keys:
                c = w["clusters"][key]
                cluster = EmulatedCluster(load_cluster_spec(ROOT / "examples" / "clusters" / f"{CLUSTERS[key]}.yaml"))
                cluster.up()
                try:
                    for k, s in enumerate(seeds):
                        cons = c["contenders"][k % len(c["contenders"]):] + c["contenders"][:k % len(c["contenders"])]
                        for con in cons:
                            if f"{con['label']}@{s}" in c["runs"]:
                                continue
                            r = c["runs"][f"{con['label']}@{s}"] = run(name, key, con, s, steps, work)
                            tt = None if "error" in r else time_to_target(r, w["targets"][str(s)])
                            print(f"{name} {CLUSTERS[key]} seed {s} {con['label']}: " + (
                                f"FAILED {r['error'][-300:]}" if "error" in r else
                                f"{1e3 * r['median_step_s']:.0f} ms/step, loss {r['final_val_loss']:.4g}, "
                                f"to target {'never' if tt is None else f'{tt:.1f} s'}"), flush=True)
                            save()
                finally:
                    cluster.down()
    save()
    print((out / "plan_target.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
