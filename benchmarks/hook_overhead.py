"""CPU cost of thinwire's hook on one bucket against PyTorch's own hooks' bodies, per call.

    .venv/bin/python benchmarks/hook_overhead.py [--numel 446000] [--reps 300]      # ~20 s

One process, a gloo group of one rank (the all-reduce moves nothing), one thread: what is left is
the CPU work each hook does around its collective, which on a CPU-bound host is added to the step.
PyTorch's rows call its own hook functions from ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``
(``allreduce_hook``: divide, all-reduce; ``bf16_compress_hook`` / ``fp16_compress_hook``: cast,
divide the half-precision copy, all-reduce, copy back) as DDP calls them, and wait on their futures.
thinwire's is the path its hook takes with error feedback, as ``thinwire.attach`` runs it
(``CommState._send``): buckets that need only all-reduces (none, fp16, bf16) go out async from the
calling thread, int8 is handed over to the communication thread (the time includes the hand-over);
and ``auto`` settled on each codec (its meters attached). Each call starts from a fresh gradient copy (not timed). Median of ``--reps`` calls, in microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thinwire.compress.hook import CommState, StaticPolicy  # noqa: E402
from thinwire.compress.spec import parse_codec_spec  # noqa: E402


class _Bucket:
    """What PyTorch's default hooks read from a ``GradBucket``: its flat buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self._buf = buf

    def buffer(self) -> torch.Tensor:
        return self._buf


def torch_body(hook):
    """PyTorch's own hook function, called as DDP calls it, waited on."""
    def body(buf: torch.Tensor) -> torch.Tensor:
        return hook(None, _Bucket(buf)).wait()
    return body


def thinwire_body(spec: str, auto: bool = False):
    if auto:
        from thinwire.auto import AutoConfig, AutoPolicy

        policy = AutoPolicy(AutoConfig(candidates=("none", spec) if spec != "none" else ("none", "bf16")))
        policy.choices = {0: spec}
    else:
        policy = StaticPolicy(parse_codec_spec(spec))
    state = CommState(policy, error_feedback=True, warmup_steps=0, min_compress_bytes=4096, nonfinite="skip")
    if auto:
        policy.bind(state)
        policy.config = type(policy.config)(candidates=policy.config.candidates, warmup_steps=1, baseline_steps=0,
                                            check_every=10**9)
    step = [1]  # auto: past its warm-up (step 1) and not due to check again

    def body(buf: torch.Tensor) -> torch.Tensor:  # the path the hook takes in training
        step[0] += 1
        return state._send(buf, 0, step[0], [tuple(buf.shape)], ((0, buf.numel()),)).wait()
    return body


def median_us(body, grad: torch.Tensor, reps: int) -> float:
    buf = grad.clone()
    times = []
    for i in range(reps + 10):
        buf.copy_(grad)
        t0 = time.perf_counter()
        body(buf)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=446_000, help="bucket size in fp32 values (default: charlm's 446k)")
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    if a.numel < 1024 or a.reps < 10:
        sys.exit("hook_overhead.py: --numel must be >= 1024 and --reps >= 10")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    grad = torch.randn(a.numel) * 1e-3
    rows = [
        ("PyTorch allreduce_hook (fp32)", torch_body(default_hooks.allreduce_hook)),
        ("PyTorch fp16_compress_hook", torch_body(default_hooks.fp16_compress_hook)),
        ("PyTorch bf16_compress_hook", torch_body(default_hooks.bf16_compress_hook)),
        ("thinwire none", thinwire_body("none")),
        ("thinwire fp16", thinwire_body("fp16")),
        ("thinwire bf16", thinwire_body("bf16")),
        ("thinwire int8", thinwire_body("int8")),
        ("thinwire auto settled on bf16", thinwire_body("bf16", auto=True)),
        ("thinwire auto settled on int8", thinwire_body("int8", auto=True)),
    ]
    print(f"torch {torch.__version__}, 1 thread, 1 rank (gloo), {a.numel:,} fp32 values, median of {a.reps} calls\n")
    print("| hook | us per bucket |\n|---|---:|")
    for name, body in rows:
        print(f"| {name} | {median_us(body, grad, a.reps):.0f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
