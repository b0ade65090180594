"""Codec throughput, compression ratio and error, against a plain copy and ``torch.topk``.

For each codec (default parameters unless ``--codecs`` names specs) and each size, on one fp32
tensor of standard normal values:

* time of ``compress`` + ``decompress`` (median of ``--repeats`` runs after one warm-up; at most 3
  runs from 100M elements up), reported as GB/s of fp32 input (``4 * numel / seconds``);
* the same against the peers measured in the same run: ``y.copy_(x)`` into a preallocated ``y``
  (the memory-bandwidth ceiling of any codec that reads its input once) and, for the sparsifiers,
  ``torch.topk(|x|, k)`` alone with top-k's default ``k = ceil(0.01 * numel)``. ``x.clone()`` is
  listed too: codecs allocate their outputs, and on CPU a fresh allocation of more than a few MB
  pays first-touch page faults (glibc hands big blocks back to the OS), so clone, not copy_, is
  the floor for a codec that writes one new fp32 tensor;
* compression ratio ``4 * numel / payload_bytes`` and relative error ``||x - x_hat|| / ||x||``.
  (Normal noise has no low-rank structure and no heavy tail, so powersgd, topk and randomk show
  their worst-case error here; real gradients fare better.)

``torch.set_num_threads(--threads)`` (default 1): per-core numbers that do not depend on what
else runs on the machine. Results go to ``benchmarks/results/codecs.md`` and ``codecs.json``
with the command that produced them and the machine they ran on.

Usage::

    .venv/bin/python benchmarks/codecs.py --sizes 1M,10M,100M --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from thinwire.compress.codecs import Codec, Meta
from thinwire.compress.codecs.common import sparse_k
from thinwire.compress.spec import REGISTRY, parse_codec_spec, spec_string

SPARSE = {"topk", "randomk"}
BASELINES = (("y.copy_(x)", "copy_s"), ("x.clone()", "clone_s"), ("torch.topk(x.abs(), 1%)", "topk_s"))
_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}


def parse_size(text: str) -> int:
    """``"10M"`` -> 10_000_000; also ``"1e6"`` and plain integers."""
    text = text.strip().upper()
    if text and text[-1] in _SUFFIX:
        return int(float(text[:-1]) * _SUFFIX[text[-1]])
    return int(float(text))


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator, lazy init
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_codec(codec: Codec, x: torch.Tensor, repeats: int) -> dict:
    meta = Meta(numel=x.numel(), seed=1)
    payload = codec.compress(x, meta)
    compress_s = median_seconds(lambda: codec.compress(x, meta), repeats)
    decompress_s = median_seconds(lambda: codec.decompress(payload, meta), repeats)
    x_hat = codec.decompress(payload, meta)
    return {
        "codec": codec.name, "spec": spec_string(codec), "numel": x.numel(),
        "compress_s": compress_s, "decompress_s": decompress_s, "total_s": compress_s + decompress_s,
        "gb_per_s": 4 * x.numel() / (compress_s + decompress_s) / 1e9,
        "ratio": 4 * x.numel() / codec.payload_bytes(x.numel()),
        "rel_error": float((x - x_hat).norm() / x.norm()),
    }


def bench_baselines(x: torch.Tensor, repeats: int) -> dict:
    y = torch.empty_like(x)
    k = sparse_k(x.numel(), 0.01)
    return {
        "copy_s": median_seconds(lambda: y.copy_(x), repeats),
        "clone_s": median_seconds(lambda: x.clone(), repeats),
        "topk_s": median_seconds(lambda: torch.topk(x.abs(), k, sorted=False), repeats),
    }


def run(codecs: list[Codec], sizes: list[int], repeats: int) -> tuple[list[dict], list[dict]]:
    rows, baselines = [], []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        reps = min(repeats, 3) if n >= 100_000_000 else repeats
        base = {"numel": n, "repeats": reps, **bench_baselines(x, reps)}
        baselines.append(base)
        for codec in codecs:
            row = bench_codec(codec, x, reps)
            row["x_copy_time"] = row["total_s"] / base["copy_s"]
            row["x_clone_time"] = row["total_s"] / base["clone_s"]
            row["x_topk_time"] = row["total_s"] / base["topk_s"] if codec.name in SPARSE else None
            rows.append(row)
            print(f"{n:>11,} {row['spec']:<10} {row['gb_per_s']:8.3f} GB/s  ratio {row['ratio']:7.2f}  "
                  f"err {row['rel_error']:.4f}", flush=True)
        del x
    return rows, baselines


def machine_info(threads: int) -> dict:
    cpu = platform.processor() or "unknown"
    if Path("/proc/cpuinfo").exists():
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu, "logical_cpus": os.cpu_count(), "torch_threads": threads,
        "python": platform.python_version(), "torch": torch.__version__,
        "os": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "load_average_1min": round(os.getloadavg()[0], 2),  # the machine is shared: timing noise
    }


def render_markdown(command: str, info: dict, rows: list[dict], baselines: list[dict]) -> str:
    lines = [
        "# Codec throughput, ratio and error", "",
        f"Command: `{command}`", "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()), "",
        "Input: fp32 standard normal. Time = median of compress + decompress (after a warm-up); "
        "GB/s of fp32 input. `x copy`, `x clone`, `x topk` = codec time / time of `y.copy_(x)`, "
        "`x.clone()`, `torch.topk(x.abs(), ceil(0.01 n))`. Error = `||x - x_hat|| / ||x||`. "
        "From 10M elements up, every fresh fp32 output costs about a `x.clone()` in page faults "
        "(see the baselines), which dominates the cheap codecs; 1M fits in cache.", "",
        "| numel | baseline | ms | GB/s |", "|---:|---|---:|---:|",
    ]
    for b in baselines:
        for name, key in BASELINES:
            gbps = 4 * b["numel"] / b[key] / 1e9
            lines.append(f"| {b['numel']:,} | {name} | {b[key] * 1e3:.2f} | {gbps:.2f} |")
    lines += ["", "| numel | codec | compress ms | decompress ms | GB/s | x copy | x clone | x topk | ratio | rel. error |",
              "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_codec_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def _codec_row(r: dict) -> str:
    topk = f"{r['x_topk_time']:.2f}" if r["x_topk_time"] is not None else ""
    cells = [f"{r['numel']:,}", r["spec"], f"{r['compress_s'] * 1e3:.2f}", f"{r['decompress_s'] * 1e3:.2f}",
             f"{r['gb_per_s']:.3f}", f"{r['x_copy_time']:.1f}", f"{r['x_clone_time']:.1f}", topk,
             f"{r['ratio']:.2f}", f"{r['rel_error']:.4f}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,10M,100M", help="comma-separated numels, e.g. 1M,10M,100M")
    parser.add_argument("--codecs", nargs="*", default=[n.value for n in REGISTRY], help="codec specs")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="output folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    codecs = [parse_codec_spec(s) for s in args.codecs]  # validate everything before running
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows, baselines = run(codecs, sizes, args.repeats)
    command = shlex.join([os.path.relpath(sys.executable), "benchmarks/codecs.py", *sys.argv[1:]])
    info = machine_info(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codecs.md").write_text(render_markdown(command, info, rows, baselines))
    payload = {"command": command, "machine": info, "baselines": baselines, "results": rows}
    (args.out / "codecs.json").write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
