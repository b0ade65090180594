"""``thinwire doctor`` against measurement on five emulated scenarios (root).

For each scenario (``benchmarks/clusters/doctor-*.yaml``: 4 x 1 Gbit/s, 4 x 100 Mbit/s, a host at a
quarter core, a host behind 20 Mbit/s, two sites joined by 50 Mbit/s) it brings the cluster up, runs
``thinwire doctor --cluster SPEC --json`` once, then trains every codec doctor priced (``thinwire
train --cluster SPEC --compression C``, ``--steps`` steps) for each seed, the codecs interleaved seed
by seed, and reads each run's median step (its first ``SKIP`` steps left out). A codec's measured
speed-up is DDP fp32's median step over its own, per seed, then the median over seeds.

Reported per scenario: doctor's recommendation, the measured best codec, whether the recommendation
is the best or within 5% of it, and each codec's predicted against measured speed-up. Speed-ups are
per step, as doctor predicts them (the loss at equal samples is the convergence guard's question,
not doctor's). Each scenario's rows are written as soon as it finishes (``--merge`` keeps the
others), so a long evaluation can be split across sessions; doctor's own report and profile are kept
under ``results/doctor_eval/SCENARIO/``. ``--redoctor FILE`` re-runs only doctor on each scenario and
judges it against the measured steps in FILE (a new doctor against the same measurements).

    .venv/bin/python benchmarks/doctor_eval.py                       # all five, 3 seeds (~45 min)
    .venv/bin/python benchmarks/doctor_eval.py --scenarios 4x100mbit --seeds 0 --merge
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from thinwire.train.metrics import read_metrics  # noqa: E402

SCENARIOS = ["4x1gbit", "4x100mbit", "slow-cpu", "slow-link", "two-sites"]
SKIP = 5          # first steps left out of a run's median (warm-up, first buckets, allocator)
WITHIN = 0.95     # a recommendation within 5% of the measured best counts
SPEEDUP_TOL = 0.20


def cli(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "thinwire", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"`thinwire {shlex.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def median_step(out: Path) -> float:
    times = [r["step_time_s"] for r in read_metrics(out) if "step_time_s" in r and r["step"] > SKIP]
    return statistics.median(times)


def scenario(name: str, seeds: list[int], steps: int, tmp: Path, keep: Path, earlier: dict | None = None) -> dict:
    spec = ROOT / "benchmarks" / "clusters" / f"doctor-{name}.yaml"
    cli("cluster", "up", str(spec))
    try:
        t0 = time.perf_counter()
        folder = tmp / f"doctor-{name}"
        report = json.loads(cli("doctor", "--cluster", str(spec), "--json", "--out", str(folder)).stdout)
        doctor_s = time.perf_counter() - t0
        (keep / name).mkdir(parents=True, exist_ok=True)
        for f in ("report.json", "profile.yaml"):
            if (folder / f).exists():
                shutil.copy(folder / f, keep / name / f)
        codecs = [c["codec"] for c in report["codecs"]]
        measured: dict[str, list[float]] = {c: [] for c in codecs}
        if earlier is not None:  # --redoctor: the measured steps of an earlier run
            measured, seeds, steps = earlier["step_s"], earlier["seeds"], earlier["steps"]
        for seed in (seeds if earlier is None else []):
            for c in codecs:
                out = tmp / f"{name}-{c.replace(':', '_')}-{seed}"
                cli("train", "--cluster", str(spec), "--compression", c, "--steps", str(steps), "--eval-every",
                    str(steps), "--seed", str(seed), "--out", str(out), "--set", "eval_batches=2")
                measured[c].append(median_step(out))
                print(f"{name} seed {seed} {c}: {measured[c][-1] * 1e3:.1f} ms", flush=True)
    finally:
        cli("cluster", "down", str(spec))
    speedup = {c: statistics.median(measured["none"][i] / measured[c][i] for i in range(len(seeds))) for c in codecs}
    predicted = {c["codec"]: c["speedup"] for c in report["codecs"]}
    best = max(speedup, key=speedup.get)
    rec = report["recommendation"]["codec"]
    return {
        "scenario": name, "seeds": seeds, "steps": steps, "doctor_wall_s": doctor_s, "doctor_elapsed_s": report["elapsed_s"],
        "comm_share": report["measured"]["comm_share"], "recommendation": rec, "measured_best": best,
        "hit": speedup[rec] >= WITHIN * speedup[best], "step_s": measured, "measured_speedup": speedup,
        "predicted_speedup": predicted,
        "speedup_error": {c: predicted[c] / speedup[c] - 1 for c in codecs},
        "model_ddp_error": report["model"]["error_vs_measured"],
    }


def markdown(command: str, rows: list[dict]) -> str:
    hits = sum(r["hit"] for r in rows)
    errs = [abs(e) for r in rows for c, e in r["speedup_error"].items() if c != "none"]
    within = sum(e <= SPEEDUP_TOL for e in errs)
    L = ["# thinwire doctor against measurement on emulated clusters", "", f"Command: `{command}`", "",
         f"Recommendation the measured best or within 5% of it: **{hits} of {len(rows)}** scenarios. Predicted "
         f"speed-ups within {SPEEDUP_TOL:.0%} of measured: **{within} of {len(errs)}** (codec, scenario) pairs, median "
         f"|error| {statistics.median(errs):.1%}." if errs else "", "",
         "Speed-up = DDP fp32's median step / the codec's, per step (median over seeds; runs interleaved seed by "
         "seed). charlm, global batch 32, the 2 cores of this machine shared by the 4 emulated hosts.", "",
         "| scenario | comm share | doctor says | measured best | hit | doctor took |", "|---|---:|---|---|---|---:|"]
    for r in rows:
        L.append(f"| {r['scenario']} | {r['comm_share']:.0%} | {r['recommendation']} | {r['measured_best']} | "
                 f"{'yes' if r['hit'] else 'no'} | {r['doctor_elapsed_s']:.0f} s |")
    L += ["", "| scenario | codec | predicted | measured | error | median step (ms, per seed) |",
          "|---|---|---:|---:|---:|---|"]
    for r in rows:
        for c in r["predicted_speedup"]:
            L.append(f"| {r['scenario']} | {c} | {r['predicted_speedup'][c]:.2f}x | {r['measured_speedup'][c]:.2f}x | "
                     f"{r['speedup_error'][c]:+.0%} | " + ", ".join(f"{v * 1e3:.0f}" for v in r["step_s"][c]) + " |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--merge", action="store_true", help="keep the other scenarios of an earlier result")
    ap.add_argument("--redoctor", help="an earlier doctor_eval.json: re-run doctor only, judged on its measured steps")
    ap.add_argument("--name", default="doctor_eval", help="file stem of the results")
    a = ap.parse_args()
    names = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    unknown = set(names) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"--scenarios: unknown {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    out = Path(a.out)
    path = out / f"{a.name}.json"
    rows = json.loads(path.read_text())["rows"] if a.merge and path.exists() else []
    earlier = {r["scenario"]: r for r in json.loads(Path(a.redoctor).read_text())["rows"]} if a.redoctor else {}
    command = shlex.join(["python", "benchmarks/doctor_eval.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="thinwire-doctor-eval-") as tmp:
        for name in names:
            if a.redoctor and name not in earlier:
                raise SystemExit(f"--redoctor: {a.redoctor} has no measurements of {name}")
            row = scenario(name, seeds, a.steps, Path(tmp), out / a.name, earlier.get(name))
            rows = [r for r in rows if r["scenario"] != name] + [row]
            rows.sort(key=lambda r: SCENARIOS.index(r["scenario"]))
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
            (out / f"{a.name}.md").write_text(markdown(command, rows))
            print(f"{name}: doctor says {row['recommendation']}, measured best {row['measured_best']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
