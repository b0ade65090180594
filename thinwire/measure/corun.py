"""How fast this machine's cores are when several are busy at once: the co-run speed.

Co-located hosts of an emulated cluster compute at the same time (collectives line them up every
step). On a virtual machine whose vCPUs share a physical core (SMT siblings) or caches and memory
bandwidth, two busy cores deliver less than twice one: measured here, on 2 cores of the development
VM, each of two concurrent single-thread processes ran the matmul-heavy step ~2.2x slower than
alone. ``corun_speed(n)`` starts ``n`` copies of the workload's training step (one thread each),
lines them up on a barrier and returns the median step time of one running alone divided by the
median of the concurrent ones (1.0 = no slowdown).

Run as a module it is one copy: ``python -m thinwire.measure.corun --workload charlm ...``.
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

from thinwire.child import pythonpath
from thinwire.errors import ThinwireError


def _copy(args: argparse.Namespace) -> None:
    import torch

    from thinwire.measure.compute import StepTimer, single_process_group
    from thinwire.workloads.registry import build_workload

    torch.set_num_threads(args.threads)
    with single_process_group():
        torch.manual_seed(0)
        wl = build_workload(args.workload, json.loads(args.model), args.data)
        timer = StepTimer(wl, bucket_mb=25.0, lr=wl.lr)
        for _ in range(3):
            timer.step(args.batch)
        Path(args.barrier, f"ready-{os.getpid()}").touch()
        while len(list(Path(args.barrier).glob("ready-*"))) < args.n:
            time.sleep(0.005)
        times = []
        start = time.perf_counter()
        for _ in range(args.steps):
            pre, _, bwd, post, _ = timer.step(args.batch)
            times.append(pre + bwd + post)
        mean = (time.perf_counter() - start) / args.steps
    # the median resists another process's rare interruption; the mean is the pace under a CPU quota, whose
    # pauses fall inside a few steps only when a step is shorter than the quota's window (the median skips them)
    print(json.dumps({"median_s": statistics.median(times), "mean_s": mean}), flush=True)


def _run(n: int, argv: list[str], timeout: float, key: str = "median_s") -> float:
    """The median over ``n`` concurrent copies of each copy's ``key`` (``median_s`` or ``mean_s``, see ``_copy``)."""
    with tempfile.TemporaryDirectory() as barrier:
        cmd = [sys.executable, "-m", "thinwire.measure.corun", *argv, "--n", str(n), "--barrier", barrier]
        env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1"}
        procs = []
        try:
            procs += [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]
            outs = collect(procs, time.monotonic() + timeout)
        finally:  # timeout, error or stop signal: no copy outlives the measurement
            kill_all(procs)
    failed = [p.returncode for p in procs if p.returncode != 0]
    if failed or not all(o.strip() for o in outs):
        raise ThinwireError(f"profile: a copy of the workload's step (the co-run speed) failed (exit code "
                            f"{failed[0] if failed else 0}; its error is above). Skip it with `thinwire profile "
                            "--no-corun`.")
    return statistics.median(json.loads(o.strip().splitlines()[-1])[key] for o in outs)


def collect(procs: list[subprocess.Popen], deadline: float) -> list[str]:
    """Every copy's stdout; ``subprocess.TimeoutExpired`` once ``deadline`` (monotonic) passes."""
    return [p.communicate(timeout=max(0.0, deadline - time.monotonic()))[0] for p in procs]


def kill_all(procs: list[subprocess.Popen]) -> None:
    """Kill the copies still running and reap all of them (no zombie, no open pipe)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.communicate()


def corun_speed(*, workload: str, model: dict, data: str | None, batch: int, threads: int = 1, n: int = 2,
                steps: int = 12, timeout: float = 300.0, max_foreign: float = 0.2, tries: int = 3) -> float:
    """Speed of each of ``n`` concurrent copies relative to one copy alone (see the module docstring).

    Other processes on the machine would make the copies look slower than they are: a measurement
    during which they used more than ``max_foreign`` cores is repeated (up to ``tries`` in all) and
    the least disturbed one is kept."""
    from thinwire.measure.foreign import ForeignCpu

    argv = ["--workload", workload, "--model", json.dumps(model), "--batch", str(batch), "--threads", str(threads),
            "--steps", str(steps)] + (["--data", data] if data else [])
    best = None
    for _ in range(tries):
        with ForeignCpu() as foreign:
            speed = _run(1, argv, timeout) / _run(n, argv, timeout)
        if best is None or foreign.cores < best[0]:
            best = (foreign.cores, speed)
        if foreign.cores <= max_foreign:
            break
    return best[1]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True)
    p.add_argument("--model", default="{}")
    p.add_argument("--data")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--barrier", required=True)
    _copy(p.parse_args(argv))


if __name__ == "__main__":
    main()
