"""Low-precision training: speed and quality of fp32, bf16 and int8, int8 matmul speed, memory budgets.

Three parts, all in one run so every ratio is against fp32 measured alongside it:

1. **Training** (``thinwire train`` in a subprocess, as a user runs it): ``charlm`` and ``digits``
   at their default steps and batch (``--steps`` overrides), seed 0, for ``--precision fp32``,
   ``bf16`` and ``int8``; and, for speed only, 20 steps of ``charlm`` at width 512. Reported: median step time and its ratio to fp32, final validation loss
   (and bits per byte / accuracy) and its difference from fp32, peak memory, and the int8 matmul
   counters (int8 runs must show zero float matmuls).
2. **Linear microbenchmark**: forward + backward of one ``width x width`` Linear on ``--rows``
   rows, fp32 ``nn.Linear`` against :class:`~thinwire.precision.Int8Linear` (pow2 and rowwise)
   and bf16 autocast, widths 64-4096; plus the bare matmul (``x @ w.T`` against
   ``torch._int_mm``) so the quantization overhead is visible.
3. **Memory budget**: ``thinwire train --set memory_budget=...`` runs; the planned micro-batches,
   the reached batch and the measured peak against the budget.

Threads: ``--threads`` (default 1: per-core numbers, steadier on a shared machine). Results go to
``benchmarks/results/precision.{md,json}`` (``--quick``: fewer steps and widths, to
``benchmarks/results/precision_quick.*``) with the command, machine and load average.

Usage::

    .venv/bin/python benchmarks/precision.py            # full: about 10 minutes on 2 cores
    .venv/bin/python benchmarks/precision.py --quick    # smoke test: about 1.5 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from thinwire.precision import Int8ComputeConfig, Int8Linear
from thinwire.precision.memory import format_bytes, parse_size

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8")
WORKLOADS = ("charlm", "digits")
BUDGETS = {"charlm": ("48MiB", "24MiB"), "digits": ("10MiB",)}  # between one sample and the full batch


def thinwire_train(out: Path, threads: int, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "thinwire", "train", "--out", str(out), "--threads", str(threads),
           "--checkpoint-every", "100000", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def bench_training(workload: str, steps: int | None, threads: int, tmp: Path, sets: tuple[str, ...] = (),
                   label: str | None = None) -> list[dict]:
    rows = []
    for prec in PRECISIONS:
        args = ["--workload", workload, "--precision", prec, "--seed", "0", *[a for kv in sets for a in ("--set", kv)]]
        if steps:
            args += ["--steps", str(steps), "--eval-every", str(steps)]
        else:  # validate once, at the end
            args += ["--eval-every", "100000"]
        s = thinwire_train(tmp / f"{(label or workload).split()[0]}-{len(sets)}-{prec}", threads, *args)
        rep = s["precision_report"]
        rows.append({"workload": label or workload, "precision": prec, "steps": s["steps"],
                     "batch": s["config"]["batch_size"], "median_step_s": s["median_step_time_s"],
                     "val_loss": s["val_loss"], "val_bpb": s.get("val_bpb"), "val_accuracy": s.get("val_accuracy"),
                     "peak_memory_bytes": s["peak_memory_bytes"], "int8_matmuls": rep.get("int8_matmuls"),
                     "float_matmuls": rep.get("float_matmuls"), "wall_s": s["wall_s"]})
        print(f"  {label or workload} {prec}: {rows[-1]['median_step_s'] * 1e3:.1f} ms/step, val_loss {s['val_loss']:.4f}",
              flush=True)
    ref = rows[0]
    for r in rows:
        r["speedup_vs_fp32"] = ref["median_step_s"] / r["median_step_s"]
        r["val_loss_rel_diff"] = (r["val_loss"] - ref["val_loss"]) / ref["val_loss"]
        if r["val_accuracy"] is not None:
            r["val_accuracy_diff_points"] = 100 * (r["val_accuracy"] - ref["val_accuracy"])
    return rows


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_linear(width: int, rows: int, repeats: int) -> dict:
    torch.manual_seed(0)
    ref = nn.Linear(width, width)
    x = torch.randn(rows, width, requires_grad=True)
    g = torch.randn(rows, width)

    def fwd_bwd(layer, autocast=False):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(x)
            y.backward(g)
            x.grad = layer.weight.grad = layer.bias.grad = None
        return run

    out = {"width": width, "rows": rows, "fp32_s": median_seconds(fwd_bwd(ref), repeats),
           "bf16_s": median_seconds(fwd_bwd(ref, autocast=True), repeats)}
    for scaling in ("pow2", "rowwise"):
        q = Int8Linear(width, width, config=Int8ComputeConfig(scaling=scaling))
        q.load_state_dict(ref.state_dict())
        out[f"int8_{scaling}_s"] = median_seconds(fwd_bwd(q), repeats)
    a, w = torch.randn(rows, width), torch.randn(width, width)
    qa, qw = torch.randint(-127, 128, (rows, width), dtype=torch.int8), torch.randint(-127, 128, (width, width), dtype=torch.int8)
    out["matmul_fp32_s"] = median_seconds(lambda: a @ w.t(), repeats)
    out["matmul_int8_s"] = median_seconds(lambda: torch._int_mm(qa, qw.t()), repeats)
    for k in ("bf16", "int8_pow2", "int8_rowwise"):
        out[f"{k}_speedup"] = out["fp32_s"] / out[f"{k}_s"]
    out["matmul_int8_speedup"] = out["matmul_fp32_s"] / out["matmul_int8_s"]
    return out


def bench_memory(workload: str, precision: str, budget: str, steps: int, threads: int, tmp: Path) -> dict:
    s = thinwire_train(tmp / f"mem-{workload}-{precision}-{budget}", threads, "--workload", workload,
                       "--precision", precision, "--steps", str(steps), "--eval-every", str(steps),
                       "--set", f"memory_budget={budget}")
    plan = s["precision_report"]["memory_plan"]
    return {"workload": workload, "precision": precision, "budget": budget, "budget_bytes": parse_size(budget),
            "batch": s["config"]["batch_size"], "micro_sizes": plan["micro_sizes"],
            "reached_batch": sum(plan["micro_sizes"]), "checkpointing": plan["activation_checkpointing"],
            "planned_peak_bytes": plan["planned_peak_bytes"], "peak_memory_bytes": s["peak_memory_bytes"],
            "within_budget": s["peak_memory_bytes"] <= parse_size(budget), "median_step_s": s["median_step_time_s"]}


def machine(threads: int) -> dict:
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "threads": threads, "python": platform.python_version(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average_1min": os.getloadavg()[0]}


def targets(train: list[dict], linear: list[dict], memory: list[dict]) -> list[tuple[str, bool, str]]:
    by = {(r["workload"], r["precision"]): r for r in train}
    out = []
    if ("charlm", "int8") in by:
        d = by["charlm", "int8"]["val_loss_rel_diff"]
        out.append(("int8 charlm val loss within 1% (relative) of fp32", abs(d) <= 0.01, f"{d:+.2%}"))
        sp = by["charlm", "bf16"]["speedup_vs_fp32"]
        out.append(("bf16 charlm >= 2x faster per step than fp32", sp >= 2, f"{sp:.2f}x"))
    if ("digits", "int8") in by:
        d = by["digits", "int8"]["val_accuracy_diff_points"]
        out.append(("int8 digits accuracy within 1 point of fp32", d >= -1, f"{d:+.2f} points"))
    wide = [r for r in linear if r["width"] >= 1024]
    if wide:
        ok = all(r["int8_pow2_speedup"] > 1 for r in wide)
        out.append(("int8 Linear fwd+bwd faster than fp32 at widths >= 1024 (pow2)", ok,
                    ", ".join(f"{r['width']}: {r['int8_pow2_speedup']:.2f}x" for r in wide)))
    if memory:
        ok = all(m["within_budget"] and m["reached_batch"] == m["batch"] for m in memory)
        out.append(("runs under --memory-budget stay within it and reach the batch", ok,
                    f"{sum(m['within_budget'] for m in memory)}/{len(memory)} within"))
    return out


def write_md(path: Path, res: dict) -> None:
    L = [f"# Low-precision training: fp32, bf16, int8\n", f"Command: `{res['command']}`\n",
         *(f"Re-run and merged: `{c}`\n" for c in res.get("reruns", [])),
         "Machine: " + ", ".join(f"{k} {v}" for k, v in res["machine"].items()) + "\n", "## Targets (issue 7)\n",
         "| target | met | measured |", "|---|---|---|"]
    L += [f"| {t} | {'yes' if ok else 'NO'} | {m} |" for t, ok, m in res["targets"]]
    L += ["", "## Training at equal steps (`thinwire train`, seed 0)\n",
          "| workload | precision | steps | ms/step | x fp32 | val loss | vs fp32 | val acc / bpb | peak memory | int8 / float matmuls |",
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["training"]:
        q = f"{r['val_accuracy']:.4f} ({r['val_accuracy_diff_points']:+.2f} pt)" if r["val_accuracy"] is not None else f"{r['val_bpb']:.4f} bpb"
        mm = f"{r['int8_matmuls']} / {r['float_matmuls']}" if r["int8_matmuls"] is not None else ""
        L.append(f"| {r['workload']} | {r['precision']} | {r['steps']} | {r['median_step_s'] * 1e3:.1f} | "
                 f"{r['speedup_vs_fp32']:.2f} | {r['val_loss']:.4f} | {r['val_loss_rel_diff']:+.2%} | {q} | "
                 f"{format_bytes(r['peak_memory_bytes'])} | {mm} |")
    L += ["", f"## One Linear, forward + backward ({res['linear'][0]['rows'] if res['linear'] else '-'} rows; "
          "speed-up = fp32 time / time)\n",
          "| width | fp32 ms | bf16 x | int8 pow2 ms | int8 pow2 x | int8 rowwise x | matmul only: int8 x |",
          "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["linear"]:
        L.append(f"| {r['width']} | {r['fp32_s'] * 1e3:.2f} | {r['bf16_speedup']:.2f} | {r['int8_pow2_s'] * 1e3:.2f} | "
                 f"{r['int8_pow2_speedup']:.2f} | {r['int8_rowwise_speedup']:.2f} | {r['matmul_int8_speedup']:.2f} |")
    L += ["", "## Memory budget (`--set memory_budget=...`; peak = live tensor bytes of a step + DDP buckets)\n",
          "| workload | precision | budget | batch | micro-batches | checkpointing | planned peak | measured peak | within |",
          "|---|---|---:|---:|---|---|---:|---:|---|"]
    for m in res["memory"]:
        L.append(f"| {m['workload']} | {m['precision']} | {m['budget']} | {m['reached_batch']}/{m['batch']} | "
                 f"{m['micro_sizes']} | {m['checkpointing']} | {format_bytes(m['planned_peak_bytes'])} | "
                 f"{format_bytes(m['peak_memory_bytes'])} | {'yes' if m['within_budget'] else 'NO'} |")
    path.write_text("\n".join(L) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="30/20 training steps, widths 64-1024, for a smoke test")
    p.add_argument("--steps", type=int, help="training steps for every run (default: each workload's default)")
    p.add_argument("--widths", default=None, help="comma-separated Linear widths (default 64..4096)")
    p.add_argument("--rows", type=int, default=1024, help="rows (tokens) of the Linear microbenchmark")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads everywhere (default 1: per-core numbers)")
    p.add_argument("--parts", default="training,linear,memory")
    p.add_argument("--out", default=None, help="results path without extension")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    steps = a.steps or (30 if a.quick else None)
    widths = [int(w) for w in a.widths.split(",")] if a.widths else ([64, 256, 1024] if a.quick else [64, 128, 256, 512, 1024, 2048, 4096])
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / ("precision_quick" if a.quick else "precision")
    parts = set(a.parts.split(","))
    res = {"command": shlex.join([".venv/bin/python", "benchmarks/precision.py", *(argv if argv is not None else sys.argv[1:])]),
           "machine": machine(a.threads), "training": [], "linear": [], "memory": []}
    with tempfile.TemporaryDirectory() as tmp:
        if "training" in parts:
            for wl in WORKLOADS:
                res["training"] += bench_training(wl, steps, a.threads, Path(tmp))
            if not a.quick:  # speed only: wider layers, where matmuls dominate the step
                res["training"] += bench_training("charlm", 20, a.threads, Path(tmp), sets=("model.width=512",),
                                                  label="charlm width 512 (speed only)")
        if "linear" in parts:
            for w in widths:
                res["linear"].append(bench_linear(w, a.rows, 2 if a.quick else a.repeats))
                print(f"  linear {w}: int8 pow2 {res['linear'][-1]['int8_pow2_speedup']:.2f}x fp32", flush=True)
        if "memory" in parts:
            for wl, budgets in BUDGETS.items():
                for budget in budgets[:1] if a.quick else budgets:
                    for prec in ("fp32", "int8"):
                        res["memory"].append(bench_memory(wl, prec, budget, 5 if a.quick else 20, a.threads, Path(tmp)))
    if parts != {"training", "linear", "memory"} and out.with_suffix(".json").exists():  # keep the other parts
        old = json.loads(out.with_suffix(".json").read_text())
        res = {**old, **{k: res[k] for k in parts}, "machine": res["machine"],
               "reruns": old.get("reruns", []) + [res["command"]]}
    res["targets"] = targets(res["training"], res["linear"], res["memory"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str))
    write_md(out.with_suffix(".md"), res)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
