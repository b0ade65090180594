"""Measure the host CPU a collective uses: seconds per byte a rank sends, at the profile's speed 1.

A gloo all-reduce is not only wire time: every byte is copied into and out of the socket (the
kernel's TCP stack), and every received chunk is summed, all on the host's CPU. On a fast link and
a slow or CPU-capped host that CPU sets the pace; on a slow link it hides under the wire but still
takes cycles from a host that has no core to spare. Measured on the development VM's emulated
cluster (4 hosts, 16 MiB): 3.6 Gbit/s of bus bandwidth at half a core per host and 2.4 Gbit/s at a
quarter, on 10 Gbit/s links, while 1 Gbit/s links ran at 95% of their rate whatever the quota.

Here two processes on this machine (one thread each, gloo over loopback, nothing listening beyond
it) all-reduce a small and a large fp32 tensor; each rep after a barrier, the slower rank's time, the
fastest of ``reps`` kept. Loopback has no wire to speak of, so the slope between the two sizes is
the CPU's: ``per_byte = (t_large - t_small) / (bytes_sent_large - bytes_sent_small)`` with
``bytes_sent = 2 (p-1)/p * n`` (one byte per byte on two ranks). The model charges
``bytes_sent * per_byte / speed`` on the slowest host (:mod:`thinwire.perf.model`).

Run as a module it is one rank: ``python -m thinwire.measure.collective --rank R ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from thinwire.child import pythonpath
from thinwire.errors import ThinwireError
from thinwire.measure.corun import collect, kill_all

SIZES = (1 << 20, 16 << 20)  # bytes of fp32 all-reduced: a small and a large message
WORLD = 2


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(args.store, WORLD)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=WORLD)
    try:
        best = []
        for size in SIZES:
            x = torch.ones(size // 4)
            dist.all_reduce(x)  # warm-up: connections, buffers
            times = []
            for _ in range(args.reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                times.append(dt.item())
            best.append(min(times))
        dist.barrier()  # leave together: gloo torn down while a peer still talks can abort
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps({"sizes": list(SIZES), "times_s": best}), flush=True)


def per_byte(sizes: list[int], times: list[float], p: int = WORLD) -> float:
    """CPU seconds per byte a rank sends, from the small and the large all-reduce (module docstring)."""
    (n0, n1), (t0, t1) = sizes, times
    f = 2 * (p - 1) / p
    return max(0.0, (t1 - t0) / (f * (n1 - n0)))


def collective_cpu(reps: int = 5, timeout: float = 120.0) -> dict:
    """``{"per_byte_s", "sizes", "times_s"}``: the host CPU of a gloo ring all-reduce (module docstring)."""
    out = run_ranks("thinwire.measure.collective", ["--reps", str(reps)], timeout, what="the collective CPU probe")
    result = json.loads(out.strip().splitlines()[-1])
    return {"per_byte_s": per_byte(result["sizes"], result["times_s"]), **result}


def run_ranks(module: str, args: list[str], timeout: float, *, what: str, world: int = WORLD, rank: int = 0) -> str:
    """Run ``python -m module --rank R --store S ARGS`` as ``world`` local ranks (two by default; one thread
    each, gloo over loopback through a file store); rank ``rank``'s output. No rank outlives the call
    (timeout, error or stop signal)."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((n for n in ("lo", "lo0") if n in names), None)  # as thinwire.train.launch's workers
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        env = {**os.environ, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1",
               **({"GLOO_SOCKET_IFNAME": loopback} if loopback else {})}
        cmd = [sys.executable, "-m", module, "--store", store, *args]
        procs = []
        try:
            procs += [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, text=True, env=env)
                      for r in range(world)]
            outs = collect(procs, time.monotonic() + timeout)
        finally:
            kill_all(procs)
    for p in procs:
        if p.returncode != 0:
            raise ThinwireError(f"{what} failed (exit {p.returncode}; its error is above). "
                               "Skip it with `thinwire profile --no-corun`.")
    return outs[rank]


def rank_args(argv: list[str] | None, doc: str) -> argparse.Namespace:
    """A probe rank's arguments, as :func:`run_ranks` passes them."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--world", type=int, default=WORLD)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    _rank(rank_args(argv, __doc__))


if __name__ == "__main__":
    main()
