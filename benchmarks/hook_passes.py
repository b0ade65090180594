"""Per-bucket passes of thinwire's summable (bf16) path against PyTorch's bf16 hook, on one core.

    .venv/bin/python benchmarks/hook_passes.py          # ~10 s

Times each tensor pass the hook makes on a 446k-value fp32 bucket (charlm's benchmark model), median
of 200, with one thread: the error-feedback add, encode, decode of a clone, the non-finite check as
it was (``torch.isfinite(x).all()``) and as it is (:func:`thinwire.compress.schemes.all_finite`),
and what PyTorch's bf16 hook does (cast, divide, cast back). Results: ``results/hook_finite_check.md``.

"encode, then decode a clone, in sequence" costs far more than its parts (seen: 1.56 ms against
0.14 + 0.06). Each call allocates fresh 0.9-1.8 MB buffers; that the cost is the allocation (new
pages faulting in) is a guess, not yet checked.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thinwire.compress.codecs.base import Meta  # noqa: E402
from thinwire.compress.schemes import all_finite  # noqa: E402
from thinwire.compress.spec import parse_codec_spec  # noqa: E402


def median_ms(f, reps: int = 200) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    n = 446_000
    x, r = torch.randn(n), torch.randn(n) * 1e-3
    xb = x.to(torch.bfloat16)
    codec, meta = parse_codec_spec("bf16"), Meta(numel=n, dtype=torch.float32, seed=1, rank=0)
    payload = codec.compress(x, meta)
    passes = {
        "error-feedback add (x + r)": lambda: x + r,
        "encode bf16": lambda: codec.compress(x, meta),
        "decode a clone (for the residual)": lambda: codec.decompress([t.clone() for t in payload], meta),
        "encode, then decode a clone, in sequence": lambda: codec.decompress([t.clone() for t in codec.compress(x, meta)], meta),
        "non-finite check, isfinite().all(), fp32": lambda: bool(torch.isfinite(x).all()),
        "non-finite check, isfinite().all(), bf16 sum": lambda: bool(torch.isfinite(xb).all()),
        "non-finite check, all_finite, fp32": lambda: all_finite(x),
        "non-finite check, all_finite, bf16 sum": lambda: all_finite(xb),
        "residual update (x - sent)": lambda: x - x,
        "PyTorch bf16 hook: cast, divide, cast back": lambda: x.to(torch.bfloat16).div_(4).to(torch.float32),
    }
    print(f"torch {torch.__version__}, 1 thread, {n:,} fp32 values, median of 200\n")
    print("| pass | ms |\n|---|---:|")
    for name, f in passes.items():
        print(f"| {name} | {median_ms(f):.3f} |")


if __name__ == "__main__":
    main()
