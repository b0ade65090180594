"""What one bucket costs the switch's aggregator in CPU: all of it, and the tensor work alone.

``p`` trainer processes and the aggregator join over gloo on loopback (no emulated links, no quotas);
each trainer sends ``--calls`` buckets of ``--numel`` values through :class:`thinwire.compress.switch.SwitchPort`.
Reported per bucket: the aggregator's process CPU time over the whole exchange (its Python loop, the
sum and re-encode, and gloo's threads sending and receiving), its wall time, each trainer's CPU, and
the aggregator's tensor work alone (:func:`switch.reduce_chunk` chunk by chunk as :func:`switch.serve` calls it,
timed in one process without any transport). Divide the aggregator's CPU by a quota to see how long a capped
aggregator (spec ``switch: {cpu: C}``) needs per bucket.

    .venv/bin/python benchmarks/switch_cpu.py                      # charlm's bucket, 4 trainers
    .venv/bin/python benchmarks/switch_cpu.py --numel 2000000 --trainers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.distributed import run_ranks  # noqa: E402
from thinwire.compress import switch  # noqa: E402
from thinwire.compress.codecs.common import n_blocks  # noqa: E402
from thinwire.measure.codec_costs import median_s  # noqa: E402


def _exchange(rank: int, world: int, numel: int, calls: int) -> dict:
    p = world - 1
    if rank == p:
        t0, c0 = time.perf_counter(), time.process_time()
        served = switch.serve(dist.group.WORLD, list(range(p)))
        return {"cpu_s": (time.process_time() - c0) / served, "wall_s": (time.perf_counter() - t0) / served}
    port = switch.SwitchPort(dist.group.WORLD, aggregator=p)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    c0 = time.process_time()
    for _ in range(calls):
        port.all_reduce(x, key=0)
    cpu = (time.process_time() - c0) / calls
    port.close()
    return {"cpu_s": cpu}


def tensor_work_s(numel: int, trainers: int, reps: int = 30, block: int = switch.BLOCK) -> float:
    """One thread's seconds for the aggregator's sum and re-encode of one bucket, chunk by chunk as serve() does."""
    torch.set_num_threads(1)
    b = n_blocks(numel, block)
    g = torch.Generator().manual_seed(0)
    bufs = [torch.randint(-127, 128, (b * block,), dtype=torch.int8, generator=g) for _ in range(trainers)]
    scale, residual = torch.rand(b, generator=g) * 0.01, torch.zeros(b * block)

    def once() -> None:  # serve()'s loop without the transport
        first = 0
        for c in switch._chunks(b, block):
            span = slice(first * block, (first + c) * block)
            switch.reduce_chunk([buf[span] for buf in bufs], scale[first : first + c], residual[span], block)
            first += c

    return median_s(once, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=445_952, help="values per bucket (default: charlm's gradient)")
    ap.add_argument("--trainers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="exchanges; medians reported")
    a = ap.parse_args(argv)
    if a.numel < 1 or a.trainers < 1 or a.calls < 1 or a.repeats < 1:
        ap.error("--numel, --trainers, --calls and --repeats must be integers >= 1")
    runs = [run_ranks(_exchange, a.trainers + 1, a.numel, a.calls, timeout=600) for _ in range(a.repeats)]
    agg_cpu = statistics.median(r[-1]["cpu_s"] for r in runs)
    agg_wall = statistics.median(r[-1]["wall_s"] for r in runs)
    trainer_cpu = statistics.median(t["cpu_s"] for r in runs for t in r[:-1])
    work = tensor_work_s(a.numel, a.trainers)
    print(f"bucket of {a.numel:,} values, {a.trainers} trainers, {a.calls} buckets x {a.repeats} exchanges "
          f"(torch {torch.__version__}, medians):")
    print(f"  aggregator: {agg_cpu * 1e3:.1f} ms CPU per bucket (wall {agg_wall * 1e3:.1f} ms); "
          f"its sum and re-encode alone {work * 1e3:.1f} ms; the rest ({(agg_cpu - work) * 1e3:.1f} ms) is the "
          "loop and gloo's sends and receives")
    print(f"  each trainer: {trainer_cpu * 1e3:.1f} ms CPU per bucket")
    for quota in (0.25, 0.5, 1.0):
        print(f"  at a {quota:g}-core quota the aggregator needs about {agg_cpu / quota * 1e3:.0f} ms per bucket")
    return 0


if __name__ == "__main__":
    sys.exit(main())
