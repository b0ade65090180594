"""What a validation costs on fewer hosts, measured against the planner's price (issue 27).

    sudo .venv/bin/python benchmarks/validation_cost.py

On plan_target's cluster b (two groups of two half-core hosts), denoise at plan_target's settings (50 global
batches: its whole 1,352-item validation set, every 15 steps), two plans of ``plan_target/``: the 2-host bfp
plan and the 4-host hierarchical bfp plan. Each trains 90 steps (6 validations), 3 seeds interleaved; one
validation's time = the gap in ``metrics.jsonl``'s wall clock between a validation record and the step
before it. Predicted: ``Decision.validation_s`` of each plan file. Writes ``results/validation_cost.md``.
"""

from __future__ import annotations

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
sys.path.insert(0, str(ROOT / "benchmarks"))

from plan_target import ENV, common  # noqa: E402

PLANS = {"2 hosts, bfp": "plan-denoise-b-alt2.yaml", "4 hosts, hierarchical, bfp": "plan-denoise-b.yaml"}
SPEC = ROOT / "examples" / "clusters" / "plan-b-two-groups.yaml"


def validations(out: Path) -> tuple[list[float], float]:
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    gaps, prev = [], None
    for r in recs:
        if "val_loss" in r and prev is not None:
            gaps.append(r["wall_s"] - prev)
        if "step_time_s" in r:
            prev = r["wall_s"]
    return gaps, statistics.median(r["step_time_s"] for r in recs if "step_time_s" in r)


def main() -> int:
    if os.geteuid() != 0:
        print("validation_cost.py needs root for the emulated cluster. Run it with sudo.")
        return 2
    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.spec import load_cluster_spec
    from thinwire.plan.planfile import read_plan

    folder = ROOT / "benchmarks" / "results" / "plan_target"
    rows = {name: {"predicted_s": read_plan(folder / f).chosen.validation_s, "measured_s": [], "step_s": []}
            for name, f in PLANS.items()}
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    cluster = EmulatedCluster(load_cluster_spec(SPEC))
    cluster.up()
    try:
        with tempfile.TemporaryDirectory(prefix="validation_cost-") as tmp:
            for seed in (0, 1, 2):
                names = list(PLANS)[seed % 2:] + list(PLANS)[:seed % 2]
                for name in names:
                    out = Path(tmp) / f"{seed}-{name.replace(' ', '_').replace(',', '')}"
                    proc = subprocess.run([sys.executable, "-m", "thinwire", "train", *common("denoise", 90, seed, out),
                                           "--cluster", str(SPEC), "--plan", str(folder / PLANS[name])],
                                          capture_output=True, text=True, env=ENV, cwd=ROOT)
                    if proc.returncode != 0:
                        raise SystemExit(f"{name}, seed {seed} failed:\n{proc.stderr[-2000:]}")
                    gaps, step = validations(out)
                    rows[name]["measured_s"].append(statistics.median(gaps))
                    rows[name]["step_s"].append(step)
                    print(f"seed {seed} {name}: validation {statistics.median(gaps):.3f} s, step {step * 1e3:.0f} ms", flush=True)
    finally:
        cluster.down()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    lines = ["# A validation's cost on fewer hosts: measured against the planner's price", "",
             f"Command: `sudo .venv/bin/python benchmarks/validation_cost.py` ({started} UTC, commit {commit}). Denoise on "
             "plan_target's cluster b (two groups of two half-core hosts), 50 global batches per validation (the whole "
             "1,352-item set) every 15 steps, 90 steps, seeds 0-2 interleaved; measured: the median over a run's 6 "
             "validations of the wall-clock gap before each; predicted: the plan file's `validation_s`.", "",
             "| plan | predicted validation (s) | measured, per seed (s) | median (s) | predicted / measured | median step (ms) |",
             "|---|---:|---|---:|---:|---:|"]
    for name, r in rows.items():
        med = statistics.median(r["measured_s"])
        lines.append(f"| {name} | {r['predicted_s']:.2f} | {', '.join(f'{m:.2f}' for m in r['measured_s'])} | {med:.2f} | "
                     f"{r['predicted_s'] / med:.2f} | {statistics.median(r['step_s']) * 1e3:.0f} |")
    (ROOT / "benchmarks" / "results" / "validation_cost.md").write_text("\n".join(lines) + "\n")
    (ROOT / "benchmarks" / "results" / "validation_cost.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
