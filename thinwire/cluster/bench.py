"""Measure all-reduce bus bandwidth across the hosts of an emulated cluster, against the spec.

One gloo process per host (inside its namespace and cgroups), rendezvous over ``tcp://`` on the
first host's address. For each message size: one warm-up all-reduce, then ``reps`` timed ones, each
after a barrier; a rep's time is the slowest rank's. Bus bandwidth follows NCCL-tests' definition
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
``busbw = 2 (p-1)/p * bytes / time``, the rate each link must carry in a ring all-reduce, so it is
directly comparable with the configured link rate. The expected value is the slowest pair's
bottleneck rate (the slowest link on the ring sets the pace). Expect ~94% of it: tbf counts
Ethernet/IP/TCP headers (1448 payload bytes per 1514 on the wire) and TCP needs some slack.

**While the hosts compute** (:func:`busy_latency`, ``thinwire cluster bench --busy``): the time of a
small all-reduce with every host idle, then with a compute thread in each worker keeping its host's CPU
busy (as backward does while DDP's buckets go out). On hosts whose ``cpu`` is a CFS quota, a collective
issued while the host computes waits for the quota: measured here, a 4-byte all-reduce across 4 hosts
at 0.45 core took ~28 ms busy against ~0.5 ms idle, about 5 ms per ring hop, far more than the
``(1-q)^2 P / 2`` a uniformly arriving message would wait; a real core of that speed adds no such wait.
The model does not price it yet; this measures it on any spec.

**In the switch** (:func:`switch_bench`, ``thinwire cluster bench --aggregation switch``, a spec with
``switch:``): a gradient of fp32 values summed as int8 across the hosts, two ways, alternating rep by
rep: around the ring as ``--compression int8`` sends it (:class:`thinwire.compress.schemes.decoded.Decoded`:
compressed reduce-scatter + all-gather, each ``2(p-1)/p`` of the payload), and through the aggregator on
the switch (:mod:`thinwire.compress.switch`: the payload up once, the sum down once). A rep's time is the
slowest host's; encoding and decoding are included on both sides.

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

from thinwire.child import pythonpath
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


def _checked_hosts(cluster: EmulatedCluster, hosts: list[str] | None) -> list[str]:
    """``hosts`` (default: all of the spec's), each known, at least 2, on a cluster that is up."""
    hosts = hosts or cluster.spec.host_names
    if len(hosts) < 2:
        raise ThinwireError(f"bench needs at least 2 hosts, got {hosts}; add a host to the spec or to --hosts.")
    for h in hosts:
        cluster.spec.host(h)
    twice = sorted({h for h in hosts if list(hosts).count(h) > 1})
    if twice:
        raise ThinwireError(f"--hosts names {', '.join(twice)} more than once ({','.join(hosts)}); name each host once.")
    cluster.require_up()
    return list(hosts)


def bench(cluster: EmulatedCluster, *, hosts: list[str] | None = None, sizes: list[int] | None = None,
          reps: int = 5, timeout: float = 300.0) -> BenchResult:
    """Run the all-reduce benchmark across ``hosts`` (default all) of a running cluster."""
    spec = cluster.spec
    hosts = _checked_hosts(cluster, hosts)
    expected = min(spec.bandwidth_bps(a, b) for a, b in combinations(hosts, 2))
    sizes = sizes or default_sizes(expected, len(hosts))
    times = _run_workers(cluster, hosts, sizes, reps, timeout)
    busbw = [bus_factor(len(hosts)) * n * 8 / statistics.median(ts) for n, ts in zip(sizes, times)]
    return BenchResult(hosts=list(hosts), sizes=sizes, busbw_bps=busbw, expected_bps=expected)


@dataclass(frozen=True)
class BusyResult:
    """Median seconds of a small all-reduce with every host idle and with every host computing;
    ``load``: the CPU share the compute thread used while busy on rank 0's host (cores)."""

    hosts: list[str]
    size: int
    idle_s: float
    busy_s: float
    load: float

    @property
    def hops(self) -> int:
        """Messages on a ring all-reduce's critical path: 2 (p-1)."""
        return 2 * (len(self.hosts) - 1)

    @property
    def wait_per_hop_s(self) -> float:
        return max(0.0, self.busy_s - self.idle_s) / self.hops


def busy_latency(cluster: EmulatedCluster, *, hosts: list[str] | None = None, size: int = 4, reps: int = 100,
                 timeout: float = 300.0) -> BusyResult:
    """A ``size``-byte all-reduce's median time with the hosts idle and while each computes (module docstring)."""
    hosts = _checked_hosts(cluster, hosts)
    out = _run_workers(cluster, hosts, [size], reps, timeout, busy=True)
    return BusyResult(hosts=list(hosts), size=size, idle_s=statistics.median(out["idle"]),
                      busy_s=statistics.median(out["busy"]), load=out["load"])


@dataclass(frozen=True)
class SwitchResult:
    """Median seconds of an int8 all-reduce of ``sizes`` (fp32 bytes of the gradient) around the ring and
    through the switch's aggregator, and every rep's."""

    hosts: list[str]
    sizes: list[int]
    ring_s: list[float]
    switch_s: list[float]
    ring_reps: list[list[float]]
    switch_reps: list[list[float]]

    @property
    def speedups(self) -> list[float]:
        return [r / s for r, s in zip(self.ring_s, self.switch_s)]


def switch_bench(cluster: EmulatedCluster, *, hosts: list[str] | None = None, sizes: list[int] | None = None,
                 reps: int = 5, timeout: float = 600.0) -> SwitchResult:
    """An int8 all-reduce around the ring and through the switch's aggregator (module docstring)."""
    spec = cluster.spec
    aggregator = cluster.aggregator()
    hosts = _checked_hosts(cluster, hosts)
    if sizes is None:  # a ring all-reduce of about 0.25 and 1 s at the slowest pair's rate, as int8
        expected = min(spec.bandwidth_bps(a, b) for a, b in combinations(hosts, 2))
        sizes = [int(min(max(4 * t * expected / 8 / bus_factor(len(hosts)), 2**20), 2**28)) // 1024 * 1024
                 for t in (0.25, 1.0)]
    out = _run_workers(cluster, hosts, sizes, reps, timeout, switch=aggregator)
    return SwitchResult(hosts=list(hosts), sizes=sizes, ring_reps=out["ring"], switch_reps=out["switch"],
                        ring_s=[statistics.median(t) for t in out["ring"]],
                        switch_s=[statistics.median(t) for t in out["switch"]])


def _run_workers(cluster: EmulatedCluster, hosts: list[str], sizes: list[int], reps: int,
                 timeout: float, dtype: str = "float32", busy: bool = False, switch=None, p2p: bool = False,
                 gap: float | None = None):
    """Start one worker per host, wait, return rank 0's times (seconds) per size and rep.

    ``sizes`` are bytes; each all-reduce sums a tensor of ``dtype`` (a ``torch`` dtype name) of that
    many bytes. ``p2p``: point-to-point times instead (:func:`_p2p_worker`; with ``gap``, a message of each size
    after that many seconds idle, :func:`_credit_worker`)."""
    master = f"{cluster.host(hosts[0]).address}:{random.randint(20000, 60000)}"
    procs = []
    places = [cluster.host(name) for name in hosts] + ([switch] if switch is not None else [])
    try:
        for rank, place in enumerate(places):
            argv = [sys.executable, "-m", "thinwire.cluster.bench", "--worker", "--rank", str(rank),
                    "--world", str(len(places)), "--master", master, "--reps", str(reps),
                    "--sizes", ",".join(map(str, sizes)), "--dtype", dtype, *(["--busy"] if busy else []),
                    *(["--switch"] if switch is not None else []), *(["--p2p"] if p2p else []),
                    *(["--gap", repr(gap)] if gap is not None else [])]
            procs.append(place.spawn(argv, env={"PYTHONPATH": pythonpath()}, stdout=subprocess.PIPE,
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
    for place, p, (_, err) in zip(places, procs, outs):
        if p.returncode != 0:
            raise ThinwireError(f"bench worker on {place.name!r} failed (exit {p.returncode}): {err.strip()[-2000:]}")
    result = json.loads(outs[0][0].strip().splitlines()[-1])
    return result if busy or switch is not None or p2p else result["times"]


def _worker(args: argparse.Namespace) -> None:
    from datetime import timedelta
    from time import perf_counter

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(seconds=120))
    if args.busy:
        _busy_worker(args)
        return
    if args.switch:
        _switch_worker(args)
        return
    if args.p2p:
        (_credit_worker if args.gap is not None else _p2p_worker)(args)
        return
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


def _timed_all_reduces(x, reps: int) -> list[float]:
    from time import perf_counter

    import torch
    import torch.distributed as dist

    out = []
    for _ in range(reps):
        t0 = perf_counter()
        dist.all_reduce(x)
        dt = torch.tensor([perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # this one waits too: only the first is timed
        out.append(dt.item())
    return out


def _p2p_worker(args: argparse.Namespace) -> None:
    """Ranks 0 and 1 pass a small tensor back and forth (``send``/``recv``, as a pipeline's stages hand
    over activations); rank 0 prints each rep's one-way time, half the round trip."""
    import time

    import torch
    import torch.distributed as dist

    x = torch.zeros(max(1, int(args.sizes.split(",")[0]) // 4))
    times = []
    for i in range(args.reps + 2):  # two warm-ups: connections, buffers
        dist.barrier()
        t0 = time.perf_counter()
        if args.rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif args.rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        if i >= 2:
            times.append((time.perf_counter() - t0) / 2)
    if args.rank == 0:
        print(json.dumps({"one_way": times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _credit_worker(args: argparse.Namespace) -> None:
    """For each of ``sizes`` (bytes), ``reps`` times: rank 0 waits ``gap`` seconds (a token bucket on the
    link refills), sends one message of that size to rank 1 and waits for a 4-byte reply. Each size is sent
    once before its series to warm the connection up. Rank 0 prints the round trips (seconds) by size."""
    import time

    import torch
    import torch.distributed as dist

    ack, out = torch.zeros(1), {}
    for size in map(int, args.sizes.split(",")):
        x, times = torch.zeros(max(1, size // 4)), []
        for i in range(args.reps + 1):
            if args.rank == 0:
                time.sleep(args.gap)
                t0 = time.perf_counter()
                dist.send(x, 1)
                dist.recv(ack, 1)
                if i >= 1:
                    times.append(time.perf_counter() - t0)
            elif args.rank == 1:
                dist.recv(x, 0)
                dist.send(ack, 0)
        out[str(size)] = times
    if args.rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _busy_worker(args: argparse.Namespace) -> None:
    """Idle all-reduces, then the same while a compute thread (matrix products, as backward runs them)
    keeps this host busy; rank 0 prints both and the compute thread's CPU share."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    x = torch.ones(max(1, int(args.sizes.split(",")[0]) // 4))
    dist.all_reduce(x)  # warm-up
    dist.barrier()
    idle = _timed_all_reduces(x, args.reps)
    stop, cpu = threading.Event(), []

    def compute():
        a = torch.randn(192, 192)
        t0 = time.thread_time()
        while not stop.is_set():
            a = torch.tanh(a @ a)
        cpu.append(time.thread_time() - t0)

    worker = threading.Thread(target=compute, daemon=True)
    dist.barrier()
    wall0 = time.perf_counter()
    worker.start()
    time.sleep(0.2)  # the quota is being spent before the first timed all-reduce
    busy = _timed_all_reduces(x, args.reps)
    stop.set()
    worker.join()
    load = cpu[0] / (time.perf_counter() - wall0)
    if args.rank == 0:
        print(json.dumps({"idle": idle, "busy": busy, "load": load}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _switch_worker(args: argparse.Namespace) -> None:
    """Ranks 0..p-1 (the hosts) time the ring's and the switch's int8 all-reduce, alternating; rank p (the
    aggregator) serves until they are done; rank 0 prints every rep's time (the slowest host's)."""
    from time import perf_counter

    import torch
    import torch.distributed as dist

    from thinwire.compress import switch
    from thinwire.compress.hook import CommState, StaticPolicy
    from thinwire.compress.schemes import scheme_for
    from thinwire.compress.schemes.base import BucketJob
    from thinwire.compress.spec import parse_codec_spec

    torch.set_num_threads(1)
    p = args.world - 1
    hosts = dist.new_group(list(range(p)))
    if args.rank == p:
        switch.serve(dist.group.WORLD, list(range(p)))
        dist.barrier()  # leave together (see _worker)
        dist.destroy_process_group()
        return
    codec = parse_codec_spec("int8")
    state = CommState(StaticPolicy(codec), error_feedback=True, warmup_steps=0, min_compress_bytes=0,
                      nonfinite="skip", group=hosts)
    port = switch.SwitchPort(dist.group.WORLD, aggregator=p)
    gen = torch.Generator().manual_seed(args.rank)

    def timed(fn) -> float:
        dist.barrier(group=hosts)
        t0 = perf_counter()
        fn()
        dt = torch.tensor([perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=hosts)
        return dt.item()

    out = {"ring": [], "switch": []}
    for k, size in enumerate(map(int, args.sizes.split(","))):
        x = torch.randn(size // 4, generator=gen)

        def ring(step: int = 0) -> None:
            scheme_for(codec).run(BucketJob(key=str(k), buf=x.clone(), step=step, shapes=[tuple(x.shape)],
                                            layout=((k, x.numel()),), codec=codec, state=state))

        def via_switch() -> None:
            port.all_reduce(x, key=k)

        ring()  # warm-up: connections, buffers
        via_switch()
        rings, switches = [], []
        for rep in range(args.reps):
            first, second = (ring, via_switch) if rep % 2 == 0 else (via_switch, ring)
            a, b = timed(first), timed(second)
            rings.append(a if first is ring else b)
            switches.append(b if first is ring else a)
        out["ring"].append(rings)
        out["switch"].append(switches)
    port.close()
    if args.rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
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
    p.add_argument("--busy", action="store_true")
    p.add_argument("--switch", action="store_true")
    p.add_argument("--p2p", action="store_true")
    p.add_argument("--gap", type=float, default=None)
    _worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
