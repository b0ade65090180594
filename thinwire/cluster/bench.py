"""Measure all-reduce bus bandwidth across the hosts of an emulated cluster, against the spec.

One gloo process per host (inside its namespace and cgroups), rendezvous over ``tcp://`` on the
first host's address. For each message size: one warm-up all-reduce, then ``reps`` timed ones, each
after a barrier; a rep's time is the slowest rank's. Bus bandwidth follows NCCL-tests' definition
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
``busbw = 2 (p-1)/p * bytes / time``, the rate each link must carry in a ring all-reduce, so it is
directly comparable with the configured link rate. The expected value is the slowest pair's
bottleneck rate (the slowest link on the ring sets the pace). Expect ~94% of it: tbf counts
Ethernet/IP/TCP headers (1448 payload bytes per 1514 on the wire) and TCP needs some slack.

Run as a module inside a host, it is the worker: ``python -m thinwire.cluster.bench --worker ...``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from thinwire.cluster.emulator import EmulatedCluster
from thinwire.errors import ThinwireError

TARGET_SECONDS = (0.25, 0.5, 1.0)  # default sizes: all-reduces lasting about this long at the expected rate


@dataclass(frozen=True)
class BenchResult:
    """Measured bus bandwidth per message size (bit/s, median of reps) against the configured rate."""

    hosts: list[str]
    sizes: list[int]
    busbw_bps: list[float]
    expected_bps: float

    @property
    def median_bps(self) -> float:
        return statistics.median(self.busbw_bps)

    @property
    def ratio(self) -> float:
        return self.median_bps / self.expected_bps


def bus_factor(p: int) -> float:
    """Bytes each rank sends per all-reduced byte in a ring: 2 (p-1) / p."""
    return 2 * (p - 1) / p


def default_sizes(expected_bps: float, p: int) -> list[int]:
    """Message sizes (bytes, multiples of 4) whose all-reduce lasts about TARGET_SECONDS each."""
    sizes = [t * expected_bps / 8 / bus_factor(p) for t in TARGET_SECONDS]
    return [int(min(max(s, 256 * 1024), 256 * 2**20)) // 4 * 4 for s in sizes]


def bench(cluster: EmulatedCluster, *, hosts: list[str] | None = None, sizes: list[int] | None = None,
          reps: int = 5, timeout: float = 300.0) -> BenchResult:
    """Run the all-reduce benchmark across ``hosts`` (default all) of a running cluster."""
    spec = cluster.spec
    hosts = hosts or spec.host_names
    if len(hosts) < 2:
        raise ThinwireError(f"bench needs at least 2 hosts, got {hosts}; add a host to the spec or to --hosts.")
    for h in hosts:
        spec.host(h)
    cluster.require_up()
    expected = min(spec.bandwidth_bps(a, b) for a, b in combinations(hosts, 2))
    sizes = sizes or default_sizes(expected, len(hosts))
    times = _run_workers(cluster, hosts, sizes, reps, timeout)
    busbw = [bus_factor(len(hosts)) * n * 8 / statistics.median(ts) for n, ts in zip(sizes, times)]
    return BenchResult(hosts=list(hosts), sizes=sizes, busbw_bps=busbw, expected_bps=expected)


def _run_workers(cluster: EmulatedCluster, hosts: list[str], sizes: list[int], reps: int,
                 timeout: float, dtype: str = "float32") -> list[list[float]]:
    """Start one worker per host, wait, return rank 0's times (seconds) per size and rep.

    ``sizes`` are bytes; each all-reduce sums a tensor of ``dtype`` (a ``torch`` dtype name) of that
    many bytes."""
    master = f"{cluster.host(hosts[0]).address}:{random.randint(20000, 60000)}"
    pythonpath = str(Path(__file__).resolve().parents[2])
    procs = []
    try:
        for rank, name in enumerate(hosts):
            argv = [sys.executable, "-m", "thinwire.cluster.bench", "--worker", "--rank", str(rank),
                    "--world", str(len(hosts)), "--master", master, "--reps", str(reps),
                    "--sizes", ",".join(map(str, sizes)), "--dtype", dtype]
            procs.append(cluster.host(name).spawn(argv, env={"PYTHONPATH": pythonpath}, stdout=subprocess.PIPE,
                                                  stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        raise ThinwireError(f"bench did not finish in {timeout:.0f} s; is a link down? "
                            "Check `thinwire cluster status SPEC`.") from None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p, (_, err) in zip(hosts, procs, outs):
        if p.returncode != 0:
            raise ThinwireError(f"bench worker on host {name!r} failed (exit {p.returncode}): {err.strip()[-2000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])["times"]


def _worker(args: argparse.Namespace) -> None:
    from datetime import timedelta
    from time import perf_counter

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    times = []
    dtype = getattr(torch, args.dtype)
    for size in map(int, args.sizes.split(",")):
        x = torch.ones(size // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
        dist.all_reduce(x)  # warm-up: connections, buffers
        per_rep = []
        for _ in range(args.reps):
            dist.barrier()
            t0 = perf_counter()
            dist.all_reduce(x)
            dt = torch.tensor([perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            per_rep.append(dt.item())
        times.append(per_rep)
    if args.rank == 0:
        print(json.dumps({"times": times}), flush=True)
    dist.barrier()  # leave together: gloo torn down while a peer still talks can abort
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    _worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
