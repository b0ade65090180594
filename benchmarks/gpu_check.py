"""The GPU path, checked in one prepared run (under 5 minutes on one GPU): NCCL, codecs and low precision on CUDA.

Three parts, each what a user runs:

1. **charlm on CUDA with NCCL** (``thinwire train --nproc 1 --compression int8``, world size 1, so the
   DDP hook and its collectives run through NCCL): for ``--precision fp32``, ``bf16`` and ``int8``, the
   device and backend the run reports, its final validation loss (parity against fp32 at equal
   samples) and median step.
2. **Training speed on CUDA**: charlm at width 512 (the default width is too small to fill a GPU), the
   three precisions interleaved repeat by repeat (``--repeats``, default 3), median step time and its
   ratio to fp32 measured in the same run.
3. **Every mode on CUDA**: ``thinwire train`` at world size 1 through NCCL with each sync mode (delayed,
   local, DiLoCo, gossip, dynamic) and each codec family (bfp, topk, PowerSGD, auto): the run finishes
   on the GPU, its loss is finite and the codec's counter moved; and ``--nproc`` above the GPU count is
   refused before anything starts. `--quick` runs three of the modes.
4. **Codec throughput on CUDA**: every codec at its defaults, compress + decompress of fp32 normal
   values (1M and 64M elements; ``torch.cuda.synchronize`` around each timing), GB/s of input,
   compression ratio and relative error, against ``y.copy_(x)`` on the same device.

Results go to ``benchmarks/results/gpu_check.{md,json}`` with the device named. On a machine without
CUDA the script refuses unless ``--cpu`` is given; ``--cpu --quick`` runs the same parts on the CPU in
about a minute (the tests run it so), writing to ``--results`` (default: a ``gpu_check_cpu`` name,
never over the GPU's results).

Usage::

    python benchmarks/gpu_check.py                          # on a GPU machine
    python benchmarks/gpu_check.py --cpu --quick --results /tmp/gc   # the CPU-only parts
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

from thinwire.compress.codecs import Meta
from thinwire.compress.spec import REGISTRY, parse_codec_spec, spec_string

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("fp32", "bf16", "int8")


def environment(device: torch.device) -> dict:
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "logical_cpus": os.cpu_count()}
    if device.type == "cuda":
        info.update(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                    bf16_supported=torch.cuda.is_bf16_supported(),
                    memory_gib=round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1))
    return info


def train(out: Path, precision: str, steps: int, sets: tuple[str, ...] = (), compression: str = "int8",
          sync: str = "allreduce", seed: int = 0) -> dict:
    """One ``thinwire train`` run as a user starts it; its summary (device, backend, loss, step)."""
    cmd = [sys.executable, "-m", "thinwire", "train", "--nproc", "1", "--workload", "charlm", "--steps", str(steps),
           "--eval-every", str(steps), "--compression", compression, "--sync", sync, "--precision", precision,
           "--seed", str(seed), "--out", str(out), *[a for kv in sets for a in ("--set", kv)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"gpu_check: `{shlex.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    return {"precision": precision, "seed": seed, "corpus_sha1": s.get("workload_info", {}).get("corpus_sha1"), "device": s.get("device"), "backend": s.get("backend"), "steps": s["steps"],
            "val_loss": s.get("val_loss"), "median_step_s": s["median_step_time_s"],
            "peak_memory_bytes": s.get("peak_memory_bytes"), "counts": s["compression_stats"].get("counts")}


def parity(tmp: Path, steps: int, seeds: int) -> list[dict]:
    """Each precision's loss against fp32's of the same seed; the seeds interleaved."""
    rows = []
    for seed in range(seeds):
        runs = [train(tmp / f"parity-{p}-{seed}", p, steps, seed=seed) for p in PRECISIONS]
        ref = runs[0]["val_loss"]
        for r in runs:
            r["loss_vs_fp32"] = r["val_loss"] / ref - 1 if ref else None
            print(f"charlm {r['precision']:>5} seed {seed} on {r['device']} ({r['backend']}): val loss "
                  f"{r['val_loss']:.4f} ({r['loss_vs_fp32']:+.2%} vs fp32), median step "
                  f"{r['median_step_s'] * 1e3:.1f} ms", flush=True)
        rows += runs
    return rows


def int8_against_cpu(device: torch.device) -> dict:
    """The int8 kernels on ``device`` against the CPU's on the same inputs.

    ``int8_matmul`` is integer arithmetic, so the device must give the CPU's result exactly (shapes
    that need cuBLASLt's padding, a transposed operand, a contraction longer than one int32 sum
    holds). One int8 ``Linear`` forward and backward (round-to-nearest, so no dither) differs only
    by float rounding in the scales and the bias: its largest relative difference is reported."""
    from thinwire.precision.int8 import Int8ComputeConfig, int8_linear
    from thinwire.precision.quant import int8_matmul

    g = torch.Generator().manual_seed(0)
    exact = []
    for m, k, n, transposed in [(17, 8, 8, False), (5, 100, 30, False), (1000, 512, 2048, True), (33, 140_000, 8, False)]:
        a = torch.randint(-127, 128, (m, k), generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k) if transposed else (k, n), generator=g, dtype=torch.int8)
        b = b.t() if transposed else b
        ref = int8_matmul(a, b).double()
        got = int8_matmul(a.to(device), b.to(device)).cpu().double()
        exact.append({"shape": [m, k, n], "transposed": transposed, "equal": bool(torch.equal(ref, got))})
    x = torch.randn(256, 384, generator=g)
    w = torch.randn(512, 384, generator=g) * 0.05
    bias = torch.randn(512, generator=g)
    gy = torch.randn(256, 512, generator=g)
    out = {}
    for scaling in ("pow2", "rowwise"):
        cfg = Int8ComputeConfig(scaling=scaling, stochastic=False)
        res = []
        for dev in (torch.device("cpu"), device):
            xs, ws = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
            y = int8_linear(xs, ws, bias.to(dev), cfg)
            y.backward(gy.to(dev))
            res.append([t.detach().cpu() for t in (y, xs.grad, ws.grad)])
        out[scaling] = {name: float((c - d).norm() / c.norm()) for name, c, d in zip(("y", "dx", "dw"), *res)}
    row = {"matmul_exact": exact, "linear_rel_diff": out}
    print(f"int8 on {device} against the CPU: matmul exact {[e['equal'] for e in exact]}, Linear rel. diff {out}",
          flush=True)
    return row


def speed(tmp: Path, steps: int, repeats: int, width: int) -> list[dict]:
    """Precisions interleaved repeat by repeat; medians and ratios to fp32 of the same run."""
    steps_by: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for rep in range(repeats):
        for p in PRECISIONS:
            r = train(tmp / f"speed-{p}-{rep}", p, steps, sets=(f"model.width={width}",))
            steps_by[p].append(r["median_step_s"])
            print(f"width {width} {p:>5} repeat {rep}: median step {r['median_step_s'] * 1e3:.1f} ms", flush=True)
    fp32 = statistics.median(steps_by["fp32"])
    return [{"precision": p, "width": width, "steps": steps, "repeats": repeats, "step_s": v,
             "median_step_s": statistics.median(v), "x_fp32": statistics.median(v) / fp32} for p, v in steps_by.items()]


#: (sync, compression) pairs: every sync mode with int8, and every codec family with allreduce
MODES = (("delayed", "int8"), ("local:period=4", "int8"), ("diloco:period=4", "int8"), ("gossip:topology=exp2", "int8"),
         ("dynamic", "int8"), ("allreduce", "bfp"), ("allreduce", "topk"), ("allreduce", "powersgd"),
         ("allreduce", "auto"))
QUICK_MODES = (("delayed", "int8"), ("gossip:topology=exp2", "int8"), ("allreduce", "powersgd"))  # --quick (the tests)


def modes(tmp: Path, steps: int, which=MODES) -> list[dict]:
    """Each sync mode and codec family through ``thinwire train`` on this device: it runs, and its loss is finite."""
    rows = []
    for sync, compression in which:
        r = train(tmp / f"mode-{len(rows)}", "fp32", steps, compression=compression, sync=sync)
        r.update(sync=sync, compression=compression)
        rows.append(r)
        print(f"{sync:<22} {compression:<9} on {r['device']} ({r['backend']}): val loss {r['val_loss']:.4f}, "
              f"median step {r['median_step_s'] * 1e3:.1f} ms, counts {r['counts']}", flush=True)
    return rows


def too_many_workers(tmp: Path) -> dict:
    """``--nproc`` one above this machine's GPU count: refused before anything starts, or (CPU) it runs."""
    n = (torch.cuda.device_count() if torch.cuda.is_available() else 1) + 1
    out = tmp / "too-many"
    cmd = [sys.executable, "-m", "thinwire", "train", "--nproc", str(n), "--workload", "digits", "--steps", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    row = {"nproc": n, "exit": proc.returncode, "stderr": proc.stderr.strip()[-600:], "folder_left": out.exists()}
    print(f"--nproc {n}: exit {proc.returncode}: {row['stderr'][-300:]}", flush=True)
    return row


def timed(fn, device: torch.device, repeats: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def codecs(device: torch.device, sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        y = torch.empty_like(x)
        copy_s = timed(lambda: y.copy_(x), device, repeats)
        for name in REGISTRY.names():
            codec = parse_codec_spec(name)
            meta = Meta(numel=n, seed=1)
            payload = codec.compress(x, meta)
            c = timed(lambda: codec.compress(x, meta), device, repeats)
            d = timed(lambda: codec.decompress(payload, meta), device, repeats)
            x_hat = codec.decompress(payload, meta)
            row = {"codec": spec_string(codec), "numel": n, "device": str(device), "compress_s": c, "decompress_s": d,
                   "gb_per_s": 4 * n / (c + d) / 1e9, "x_copy_time": (c + d) / copy_s,
                   "ratio": 4 * n / codec.payload_bytes(n), "rel_error": float((x - x_hat.to(x.dtype)).norm() / x.norm())}
            rows.append(row)
            print(f"{n:>11,} {row['codec']:<24} {row['gb_per_s']:9.2f} GB/s  ratio {row['ratio']:7.2f}  "
                  f"err {row['rel_error']:.4f}", flush=True)
        del x, y
    return rows


def markdown(command: str, res: dict) -> str:
    env = res["environment"]
    L = [f"# The GPU path: NCCL, low precision and codecs on {env['device']}", "",
         f"Command: `{command}`", "", "Machine: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
         f"## charlm, world size 1, `--compression int8`, {res['parity'][0]['steps']} steps, seeds interleaved", "",
         "The corpus is the running interpreter's standard library (`corpus_sha1` in the JSON), so losses compare "
         "within one machine, not with another Python's.", "",
         "| precision | seed | device | backend | val loss | vs fp32 | median step (ms) | peak memory (MiB) |",
         "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in res["parity"]:
        L.append(f"| {r['precision']} | {r.get('seed', 0)} | {r['device']} | {r['backend']} | {r['val_loss']:.4f} | {r['loss_vs_fp32']:+.2%} | "
                 f"{r['median_step_s'] * 1e3:.1f} | {(r['peak_memory_bytes'] or 0) / 2**20:.0f} |")
    for prec in PRECISIONS[1:]:
        gaps = [r["loss_vs_fp32"] for r in res["parity"] if r["precision"] == prec]
        L.append(f"\n{prec}: median loss vs fp32 {statistics.median(gaps):+.2%} over {len(gaps)} seed(s).")
    if "int8_against_cpu" in res:
        ic = res["int8_against_cpu"]
        L += ["", f"## int8 kernels on {env['device']} against the CPU's, same inputs", "",
              "| int8_matmul (m, k, n) | transposed operand | equal to the CPU's |", "|---|---|---|"]
        L += [f"| {tuple(e['shape'])} | {e['transposed']} | {e['equal']} |" for e in ic["matmul_exact"]]
        L += ["", "| int8 Linear (round to nearest) | y | dx | dW |", "|---|---:|---:|---:|"]
        L += [f"| {k} | {v['y']:.1e} | {v['dx']:.1e} | {v['dw']:.1e} |" for k, v in ic["linear_rel_diff"].items()]
    sp = res["speed"]
    L += ["", f"## Training speed: charlm width {sp[0]['width']}, {sp[0]['steps']} steps, {sp[0]['repeats']} repeats "
          "interleaved", "", "| precision | median step (ms) | / fp32 | each repeat (ms) |", "|---|---:|---:|---|"]
    for r in sp:
        L.append(f"| {r['precision']} | {r['median_step_s'] * 1e3:.1f} | {r['x_fp32']:.2f} | "
                 + ", ".join(f"{v * 1e3:.1f}" for v in r["step_s"]) + " |")
    L += ["", f"## Every mode on {env['device']}: charlm, world size 1, fp32, {res['modes'][0]['steps']} steps", "",
          "| sync | compression | device | backend | val loss | median step (ms) | codec counts |",
          "|---|---|---|---|---:|---:|---|"]
    for r in res["modes"]:
        L.append(f"| {r['sync']} | {r['compression']} | {r['device']} | {r['backend']} | {r['val_loss']:.4f} | "
                 f"{r['median_step_s'] * 1e3:.1f} | {r['counts']} |")
    t = res["too_many_workers"]
    L += ["", f"`--nproc {t['nproc']}` (one more worker than GPUs): exit {t['exit']}, run folder left: "
          f"{t['folder_left']}."] + (["", "```", t["stderr"], "```"] if t["stderr"] else [])
    L += ["", "## Codecs (compress + decompress of fp32 normal values)", "",
          "| numel | codec | GB/s | x copy | ratio | rel. error |", "|---:|---|---:|---:|---:|---:|"]
    for r in res["codecs"]:
        L.append(f"| {r['numel']:,} | {r['codec']} | {r['gb_per_s']:.2f} | {r['x_copy_time']:.1f} | {r['ratio']:.2f} | "
                 f"{r['rel_error']:.4f} |")
    return "\n".join(L) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run the parts on the CPU (no CUDA here)")
    ap.add_argument("--quick", action="store_true", help="fewer steps, smaller tensors, one repeat")
    ap.add_argument("--repeats", type=int, default=None, help="speed repeats (default 3; 1 with --quick)")
    ap.add_argument("--seeds", type=int, default=None, help="parity seeds (default 3; 1 with --quick)")
    ap.add_argument("--results", type=Path, default=None, help="folder for gpu_check.{md,json}")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available() and not a.cpu:
        print("gpu_check: no CUDA device here; pass --cpu to run the CPU parts", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not a.cpu else torch.device("cpu")
    results = a.results or ROOT / "benchmarks" / "results" / ("gpu_check" if device.type == "cuda" else "gpu_check_cpu")
    name = "gpu_check" if device.type == "cuda" else "gpu_check_cpu"
    repeats = a.repeats or (1 if a.quick else 3)
    seeds = a.seeds or (1 if a.quick else 3)
    steps, speed_steps, mode_steps = (10, 6, 8) if a.quick else (300, 60, 40)
    sizes = [2**16] if a.quick else [2**20, 2**26]
    command = shlex.join(["python", "benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    res = {"command": command, "environment": environment(device)}
    results.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a run cut short still leaves the parts it finished
        (results / f"{name}.json").write_text(json.dumps(res, indent=1))

    with tempfile.TemporaryDirectory(prefix="thinwire-gpu-check-") as tmp:
        res["int8_against_cpu"] = int8_against_cpu(device)
        save()
        res["parity"] = parity(Path(tmp), steps, seeds)
        save()
        res["modes"] = modes(Path(tmp), mode_steps, QUICK_MODES if a.quick else MODES)
        res["too_many_workers"] = too_many_workers(Path(tmp))
        save()
        res["speed"] = speed(Path(tmp), speed_steps, repeats, width=128 if a.quick else 512)
        save()
    res["codecs"] = codecs(device, sizes, repeats=3 if a.quick else 10)
    save()
    (results / f"{name}.md").write_text(markdown(command, res))
    print(f"wrote {results / name}.md and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
