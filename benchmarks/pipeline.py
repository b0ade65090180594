"""Pipelined training on emulated clusters (issue 23): what a pipeline costs and what helps it.

Scenarios (``--scenarios``, each one cluster; contenders interleaved seed by seed, every contender once per
seed before the next seed, medians over seeds):

* ``thin-links``: 4 hosts x 100 Mbit/s, 0.45 core each, charlm cut into 4 stages (1F1B). Contenders: the
  activations and their gradients between stages in fp32, bf16 and int8 (``--pipeline 1f1b:activations=...``),
  and fp32 on unshaped links (the compute floor of the same pipeline). Reports the median step, the final
  validation loss at equal samples and its difference from fp32's (fp32 links compute what one process
  computes, ``tests/test_pipeline.py``: it is the loss control).

Each run is ``thinwire train --cluster SPEC --pipeline ...`` as a user would start it; step times are the
medians of each run's ``step_time_s`` after its first 5 steps (shape inference and warm-up), and the
validation loss is the run's own at the last step. Writes ``benchmarks/results/pipeline.{json,md,png}``;
``--merge`` keeps the other scenarios' rows. Needs root::

    sudo .venv/bin/python benchmarks/pipeline.py --scenarios thin-links --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from thinwire.cluster.emulator import EmulatedCluster  # noqa: E402
from thinwire.cluster.spec import load_cluster_spec  # noqa: E402
from thinwire.train.metrics import read_metrics  # noqa: E402

WARM = 5  # steps left out of the median: the schedule's shape inference and the first, slower steps


def spec_text(name: str, hosts: list[dict], rate: str, cpu: float, subnet: str) -> str:
    lines = [f"name: {name}", f"subnet: {subnet}", f"defaults: {{bandwidth: {rate}, cpu: {cpu}}}", "hosts:"]
    lines += ["  - {" + ", ".join(f"{k}: {v}" for k, v in h.items()) + "}" for h in hosts]
    return "\n".join(lines) + "\n"


SCENARIOS = {
    "thin-links": {
        "about": "4 hosts x 100 Mbit/s, 0.45 core each; charlm 2 x 64 wide, context 128, 4 stages, 1F1B, batch 32",
        "hosts": 4, "rate": "100mbit", "cpu": 0.45, "subnet": "10.238.0.0/24", "floor_subnet": "10.239.0.0/24",
        "model": {"layers": 2, "width": 64, "heads": 4, "context": 128}, "batch": 32, "steps": 300, "evals": 6,
        "contenders": {
            "fp32": ["--pipeline", "1f1b:activations=fp32"],
            "bf16": ["--pipeline", "1f1b:activations=bf16"],
            "int8": ["--pipeline", "1f1b:activations=int8"],
            "fp32, unshaped links (floor)": ["--pipeline", "1f1b:activations=fp32"],
        },
        "unshaped": ["fp32, unshaped links (floor)"],
        "control": "fp32",
    },
}


def train_argv(sc: dict, args: list[str], out: Path, seed: int, spec: Path) -> list[str]:
    steps = sc["steps"]
    return [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "charlm",
            "--steps", str(steps), "--batch-size", str(sc["batch"]), "--threads", "1", "--seed", str(seed),
            "--eval-every", str(max(1, steps // sc["evals"])), "--checkpoint-every", str(steps),
            "--set", "warmup_steps=10", "--out", str(out), *args,
            *(a for k, v in sc["model"].items() for a in ("--set", f"model.{k}={v}"))]


def run_one(sc: dict, name: str, out: Path, seed: int, spec: Path) -> dict:
    t0 = time.time()
    proc = subprocess.run(train_argv(sc, sc["contenders"][name], out, seed, spec), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=1800)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    recs = read_metrics(out)
    steps = [r for r in recs if "step_time_s" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "elapsed_s": time.time() - t0,
            "median_step_s": statistics.median(r["step_time_s"] for r in steps[WARM:]),
            "median_activation_bytes": statistics.median(r.get("activation_bytes", 0) for r in steps[WARM:]),
            "val": [[r["step"], r["val_loss"]] for r in recs if "val_loss" in r],
            "final_val_loss": summary.get("val_loss"), "pipeline": summary.get("pipeline"),
            "loss": [[r["step"], r["loss"]] for r in steps]}


def bench(key: str, seeds: list[int], work: Path) -> dict:
    sc = SCENARIOS[key]
    hosts = [{"name": f"h{i}"} for i in range(sc["hosts"])]
    shaped = work / f"{key}.yaml"
    shaped.write_text(spec_text(f"pipe-{key}", hosts, sc["rate"], sc["cpu"], sc["subnet"]))
    floor = work / f"{key}-floor.yaml"
    floor.write_text(spec_text(f"pipe-{key}-floor", hosts, "100gbit", sc["cpu"], sc["floor_subnet"]))
    runs: dict[str, list[dict]] = {name: [] for name in sc["contenders"]}
    clusters = {s: EmulatedCluster(load_cluster_spec(s)) for s in (shaped, floor)}
    for c in clusters.values():
        c.up()
    try:
        for seed in seeds:  # seed-major: every contender once per seed, so a slow spell hits them all
            for k, name in enumerate(sc["contenders"]):
                spec = floor if name in sc.get("unshaped", []) else shaped
                out = work / f"{key}-c{k}-s{seed}"
                print(f"[{key}] {name}, seed {seed} ...", flush=True)
                r = run_one(sc, name, out, seed, spec)
                runs[name].append(r)
                print(f"    {r['median_step_s'] * 1e3:.0f} ms/step, val {r['final_val_loss']:.4f}" if "error" not in r
                      else f"    FAILED: {r['error'][-600:]}", flush=True)
    finally:
        for c in clusters.values():
            c.down()
    return {"scenario": key, "about": sc["about"], "seeds": seeds, "control": sc["control"], "runs": runs,
            "steps": sc["steps"], "batch": sc["batch"], "model": sc["model"]}


def med(runs: list[dict], field: str) -> float | None:
    xs = [r[field] for r in runs if "error" not in r and r.get(field) is not None]
    return statistics.median(xs) if xs else None


def markdown(results: dict) -> str:
    out = ["# Pipelined training on emulated clusters", "",
           "Produced by `sudo .venv/bin/python benchmarks/pipeline.py --scenarios SCENARIO --seeds 0,1,2 --merge` "
           f"({time.strftime('%Y-%m-%d')}, this 2-core VM; each host an emulated machine with its own network "
           "namespace, tc-shaped link and cgroup CPU quota). Contenders interleaved seed by seed; medians over seeds. "
           f"Step times: median of each run's steps after the first {WARM}.", ""]
    for key, r in results.items():
        ctl = r["runs"][r["control"]]
        ctl_step, ctl_loss = med(ctl, "median_step_s"), med(ctl, "final_val_loss")
        out += [f"## {key}", "", r["about"] + f"; {r['steps']} steps, seeds {r['seeds']}.", "",
                "| contender | median step (ms) | speed-up vs " + r["control"] + " | bytes sent per step, rank 0 (MB) "
                "| final val loss (median) | vs " + r["control"] + " |", "|---|---:|---:|---:|---:|---:|"]
        for name, runs in r["runs"].items():
            step, loss = med(runs, "median_step_s"), med(runs, "final_val_loss")
            if step is None:
                out.append(f"| {name} | failed | | | | |")
                continue
            out.append(f"| {name} | {step * 1e3:.0f} | {ctl_step / step:.2f}x | "
                       f"{med(runs, 'median_activation_bytes') / 1e6:.2f} | {loss:.4f} | {(loss / ctl_loss - 1) * 100:+.2f}% |")
        out.append("")
    return "\n".join(out)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (key, r) in zip(axes[0], results.items()):
        for name, runs in r["runs"].items():
            ok = [x for x in runs if "error" not in x]
            if not ok:
                continue
            seed0 = ok[0]
            t = [s * seed0["median_step_s"] for s, _ in seed0["val"]]
            ax.plot(t, [v for _, v in seed0["val"]], marker="o", ms=3, label=f"{name} ({seed0['median_step_s'] * 1e3:.0f} ms/step)")
        ax.set_xlabel("seconds (steps x median step), seed " + str(r["seeds"][0]))
        ax.set_ylabel("validation loss")
        ax.set_title(key)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--merge", action="store_true", help="keep the other scenarios of results/pipeline.json")
    ap.add_argument("--name", default="pipeline")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("benchmarks/pipeline.py needs root (network namespaces, tc, cgroups)")
    keys = [k.strip() for k in a.scenarios.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {unknown}; known: {', '.join(SCENARIOS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    path = RESULTS / f"{a.name}.json"
    results = json.loads(path.read_text()) if a.merge and path.exists() else {}
    work = Path(tempfile.mkdtemp(prefix="thinwire-pipeline-"))
    for key in keys:
        results[key] = bench(key, seeds, work)
        path.write_text(json.dumps(results, indent=1))  # each scenario's rows as soon as they exist
        (RESULTS / f"{a.name}.md").write_text(markdown(results))
    plot(results, RESULTS / f"{a.name}.png")
    print((RESULTS / f"{a.name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
