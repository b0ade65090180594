"""``--sync delayed`` with each weight prediction and without against DDP fp32, loss at equal samples (issue 21).

    .venv/bin/python benchmarks/delayed_predict.py                     # 4 workloads x 4 contenders x 3 seeds (~45 min)
    .venv/bin/python benchmarks/delayed_predict.py --workloads digits --seeds 0 --out /tmp/d   # a smoke run

One step of staleness computes each gradient at ``w_t`` and applies it to ``w_{t+1}``; with weight
prediction the gradient is computed where ``w_{t+1}`` is predicted to be instead
(:mod:`thinwire.compress.sync.delayed`): by the optimizer's step with the rank's own last gradient
(``delayed``, the default ``predict=own``) or by repeating the last update (``predict=last``). For each
workload of ``benchmarks/guard_eval.py`` (charlm at the head-to-head's size, digits,
``benchmarks/workloads/denoise.py``, ``benchmarks/workloads/grulm.py``), at its full run (default steps,
learning rate, batch), ``thinwire train --nproc 4``: DDP fp32 (``--compression none``), ``--sync
delayed:predict=off`` (plain staleness, Pipe-SGD), ``delayed:predict=last`` and ``delayed``; seed by seed,
the contenders' order rotated by one per seed. Local workers: the loss at equal samples does not depend on
the link, and no time is measured. Then the convergence guard (``thinwire.measure.convergence``, as
``thinwire profile`` runs it) on each workload: its verdict on ``delayed``.

Every run is saved to the JSON as it ends; a second call with the same ``--out`` skips what is there.
Writes ``delayed_predict.{json,md,png}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.guard_eval import ENV, WORKLOADS, sets, write_json  # noqa: E402
from thinwire.measure.file import REACH_TOL  # noqa: E402

CONTENDERS = {  # name: train flags
    "fp32": ["--compression", "none"],
    "delayed:predict=off": ["--compression", "none", "--sync", "delayed:predict=off"],
    "delayed:predict=last": ["--compression", "none", "--sync", "delayed:predict=last"],
    "delayed": ["--compression", "none", "--sync", "delayed"],
}


def train(name: str, contender: str, seed: int, folder: Path) -> dict:
    """Final validation loss and the validation curve of one local run (4 workers)."""
    workload, model, batch, steps = WORKLOADS[name]
    out = folder / f"{name}-{contender.replace(':', '_').replace('=', '')}-s{seed}"
    r = subprocess.run([sys.executable, "-m", "thinwire", "train", "--workload", workload, *sets(model),
                        *CONTENDERS[contender], "--nproc", "4", "--threads", "1", "--steps", str(steps),
                        "--batch-size", str(batch), "--seed", str(seed), "--eval-every", str(steps // 10),
                        "--checkpoint-every", str(steps), "--set", "eval_batches=50", "--out", str(out)],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{name} {contender} seed {seed} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    curve = [(rec["step"], rec["val_loss"]) for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in rec]
    return {"val_loss": json.loads((out / "summary.json").read_text())["val_loss"], "curve": curve}


def guard(name: str) -> dict:
    """The convergence guard's record of ``delayed`` on ``name``, as ``thinwire profile`` measures it."""
    from thinwire.measure.convergence import GUARD_STEPS, GUARD_WORLD, measure_convergence
    from thinwire.workloads.registry import build_workload

    workload, model, batch, _ = WORKLOADS[name]
    rec = measure_convergence(build_workload(workload, dict(model), None), [], world=GUARD_WORLD, batch=batch,
                              steps=GUARD_STEPS, delayed=True)["delayed"]
    return {"gap": rec.gap, "factor": rec.factor, "reaches": rec.reaches}


def gaps(w: dict, contender: str, seeds: list[int]) -> list[float]:
    return [w["runs"][f"{contender}@{s}"]["val_loss"] / w["runs"][f"fp32@{s}"]["val_loss"] - 1 for s in seeds
            if f"{contender}@{s}" in w["runs"] and f"fp32@{s}" in w["runs"]]


def render(data: dict, out: Path) -> None:
    seeds = data["seeds"]
    lines = ["# One-step-stale averaging with and without weight prediction (issue 21)", "",
             f"Command: `{data['command']}`  ",
             f"Runs {data['started']} to {data['ended']} UTC, commit {data['commit']}. `thinwire train --nproc 4` "
             "(local workers, loss at equal samples; nothing timed) at each workload's full run: DDP fp32, "
             "`--sync delayed:predict=off` (plain one-step staleness, Pipe-SGD), `delayed:predict=last` (the "
             "gradient computed at the weights predicted by repeating the last update) and `--sync delayed` (the "
             "default, `predict=own`: at the weights the optimizer's step with the rank's own last gradient gives); "
             f"seeds {', '.join(map(str, seeds))}, seed by seed, order rotated. Validation on 50 global batches. "
             "Gap: final validation loss / DDP fp32's on the same seed - 1, median (per seed). Guard: the "
             "convergence guard's verdict on `delayed` from its short one-process runs (`thinwire profile`'s).", "",
             "| workload | DDP fp32 (per seed) | plain staleness | predict=last | predict=own (default) | own within 1% "
             "| guard says |", "|---|---|---:|---:|---:|---|---|"]
    for name, w in data["workloads"].items():
        fp = [w["runs"].get(f"fp32@{s}", {}).get("val_loss") for s in seeds]
        cols = []
        for c in ("delayed:predict=off", "delayed:predict=last", "delayed"):
            g = gaps(w, c, seeds)
            cols.append(f"{100 * statistics.median(g):+.2f}% ({', '.join(f'{100 * x:+.2f}' for x in g)})" if g else "-")
        g = gaps(w, "delayed", seeds)
        within = "yes" if g and statistics.median(g) <= REACH_TOL else "no" if g else "-"
        gd = w.get("guard")
        says = f"{'reaches' if gd['reaches'] else 'does not'} ({100 * gd['gap']:+.2f}%)" if gd else "-"
        lines.append(f"| {name} | {', '.join('-' if x is None else f'{x:.4f}' for x in fp)} | {' | '.join(cols)} | "
                     f"{within} | {says} |")
    (out / "delayed_predict.md").write_text("\n".join(lines) + "\n\n![validation loss](delayed_predict.png)\n")
    plot(data, out / "delayed_predict.png")


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(data["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.4), squeeze=False)
    seed = data["seeds"][0]
    for ax, name in zip(axes[0], names):
        for c, color in zip(CONTENDERS, ("black", "tab:red", "tab:orange", "tab:blue")):
            run = data["workloads"][name]["runs"].get(f"{c}@{seed}")
            if run:
                ax.plot(*zip(*run["curve"]), label=c, color=color)
        ax.set_title(f"{name} (seed {seed})")
        ax.set_xlabel("step")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rerender", action="store_true", help="rewrite the .md and .png from the .json, run nothing")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "delayed_predict.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if args.rerender:
        render(data, out)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    data.setdefault("started", time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
    data.update(command="benchmarks/delayed_predict.py " + " ".join(sys.argv[1:]), commit=commit,
                seeds=sorted(set(data.get("seeds", [])) | set(seeds)))
    data.setdefault("workloads", {})
    with __import__("tempfile").TemporaryDirectory(prefix="delayed_predict-") as tmp:
        for k, seed in enumerate(seeds):
            n = len(CONTENDERS)
            order = list(CONTENDERS)[k % n:] + list(CONTENDERS)[:k % n]
            for name in names:
                w = data["workloads"].setdefault(name, {"runs": {}})
                for c in order:
                    if f"{c}@{seed}" in w["runs"]:
                        continue
                    t0 = time.time()
                    w["runs"][f"{c}@{seed}"] = train(name, c, seed, Path(tmp))
                    print(f"{name} {c} seed {seed}: {w['runs'][f'{c}@{seed}']['val_loss']:.4f} "
                          f"({time.time() - t0:.0f} s)", flush=True)
                    write_json(path, data)
        for name in names:
            if "guard" not in data["workloads"][name]:
                data["workloads"][name]["guard"] = guard(name)
                print(f"{name} guard: {data['workloads'][name]['guard']}", flush=True)
                write_json(path, data)
    render(data, out)
    print((out / "delayed_predict.md").read_text())


if __name__ == "__main__":
    main()
