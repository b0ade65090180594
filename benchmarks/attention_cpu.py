"""CPU attention under bf16: PyTorch's bf16 flash kernel against fp32, and thinwire's policy.

Times forward + backward of causal ``scaled_dot_product_attention`` (median of ``--repeats``,
one thread) for three variants: fp32 inputs; bf16 inputs on PyTorch's bf16 kernel; bf16 inputs
under ``thinwire.precision.autocast_context("bf16")``, which on CPUs without AMX runs the fp32
kernel (:mod:`thinwire.precision.attention`). Speed-ups are against fp32 in the same run.
Results: ``benchmarks/results/attention_cpu.md``.

Usage::

    .venv/bin/python benchmarks/attention_cpu.py      # about 30 s
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from thinwire.precision import attention, autocast_context

SHAPES = [(32, 4, 128, 32), (32, 8, 128, 64), (8, 4, 512, 32)]  # (batch, heads, sequence, head dim)


def timed(dtype: torch.dtype, shape: tuple, repeats: int, policy: bool) -> float:
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=dtype)
    times = []
    for _ in range(repeats + 2):
        t = time.perf_counter()
        with autocast_context("bf16", "cpu") if policy else torch.autocast("cpu", enabled=False):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y.backward(grad)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "attention_cpu.md"))
    a = ap.parse_args()
    torch.set_num_threads(1)
    slow = attention.bf16_attention_is_slow()
    lines = ["# CPU attention in bf16: forward + backward, causal, one thread", "",
             "Command: `.venv/bin/python benchmarks/attention_cpu.py`  ",
             f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"cpu capability {torch.backends.cpu.get_cpu_capability()}, AMX tiles: {not slow}. "
             f"Median of {a.repeats}; speed-up = fp32 time / time.", "",
             "| shape (batch, heads, seq, head dim) | fp32 ms | bf16 kernel ms | bf16 kernel x | thinwire bf16 ms | thinwire bf16 x |",
             "|---|---:|---:|---:|---:|---:|"]
    for shape in SHAPES:
        f32 = timed(torch.float32, shape, a.repeats, False)
        b16 = timed(torch.bfloat16, shape, a.repeats, False)
        tw = timed(torch.bfloat16, shape, a.repeats, True)
        lines.append(f"| {shape} | {f32 * 1e3:.1f} | {b16 * 1e3:.1f} | {f32 / b16:.2f} | {tw * 1e3:.1f} | {f32 / tw:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", "thinwire bf16 = bf16 inputs under `autocast_context(\"bf16\")`: on a CPU without AMX attention runs "
              "in fp32 (inputs cast up, output cast back); with AMX it is PyTorch's bf16 kernel."]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
