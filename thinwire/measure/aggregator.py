"""Measure the switch's aggregator's CPU per bucket: what the model charges an aggregator with a CPU cap.

The aggregator (:func:`thinwire.compress.switch.serve`) does more than sum: for every trainer and every
chunk it posts a receive and a send, waits on them and slices tensors, and its gloo threads copy every
byte through the TCP stack. Per bucket of charlm's 446K values from 4 trainers that came to about 9 ms
of CPU on the development VM, of which 1.8 ms the sum and re-encode and about 2 ms what an all-reduce's
per-byte CPU would say (``benchmarks/results/switch_cpu.md``): pricing it from the per-byte CPU and
the tensor kernels alone put it at a third of that.

Here ``p`` trainer processes and the aggregator (``p + 1`` local ranks, one thread each, gloo over
loopback through a file store) exchange buckets of a small and a large size through
:class:`~thinwire.compress.switch.SwitchPort`, after a warm-up round that opens the connections, in
3 rounds of both sizes (the median of each size's kept: one busy moment of the machine moves one
round). The aggregator's process CPU time (its thread and gloo's) per bucket at the two sizes gives a line,
``cpu(n) = per_bucket_s + per_value_s * n`` for ``p`` trainers, at the profile's speed 1 (this machine,
uncapped). The model scales it by ``p`` for other host counts (every trainer's messages and bytes pass
through the aggregator) and divides by the aggregator's cores (:func:`thinwire.perf.model.aggregator_s`).

The trainers' side is timed the same way (each trainer's process CPU per exchange, the mean over the
trainers): the agreed scales, quantizing, a send and a receive per chunk, decoding. It came to about 7.5 ms
for charlm's bucket where an all-reduce's per-byte CPU and the int8 kernels say about 2
(``switch_cpu.md``); the model charges it as the bucket's host CPU (:func:`thinwire.perf.model.bucket_cost`).

Run as a module it is one rank: ``python -m thinwire.measure.aggregator --rank R --world W ...``.
"""

from __future__ import annotations

import json
import statistics
import time

from thinwire.measure.collective import rank_args, run_ranks

SIZES = (65_536, 524_288)  # values per bucket: a small and a large one
CALLS = 8                  # buckets per size and round
ROUNDS = 3                 # rounds of both sizes, alternating; each size's median is kept


def _rank(args) -> None:
    import torch
    import torch.distributed as dist

    from thinwire.compress import switch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, args.world), rank=args.rank,
                            world_size=args.world)
    trainers = list(range(args.world - 1))
    rounds = [(SIZES[0], 2)] + [(n, args.reps) for _ in range(ROUNDS) for n in SIZES]  # the first warms up
    try:
        cpu = []
        for size, calls in rounds:
            c0 = time.process_time()
            if args.rank == args.world - 1:
                served = switch.serve(dist.group.WORLD, trainers)
                cpu.append((time.process_time() - c0) / max(1, served))
            else:
                port = switch.SwitchPort(dist.group.WORLD, aggregator=args.world - 1)
                x = torch.randn(size, generator=torch.Generator().manual_seed(args.rank))
                c0 = time.process_time()
                for _ in range(calls):
                    port.all_reduce(x, key=0)
                cpu.append((time.process_time() - c0) / calls)
                port.close()
        # the trainers' CPU per exchange, summed over them (the aggregator adds zeros), for their mean
        mine = torch.tensor(cpu if args.rank < args.world - 1 else [0.0] * len(rounds), dtype=torch.float64)
        dist.all_reduce(mine)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank == args.world - 1:  # each size's median over the rounds
        def medians(per_round: list[float]) -> list[float]:
            return [statistics.median(c for (m, _), c in zip(rounds[1:], per_round[1:]) if m == n) for n in SIZES]
        print(json.dumps({"sizes": list(SIZES), "cpu_s": medians(cpu),
                          "trainer_cpu_s": medians([c / len(trainers) for c in mine.tolist()])}), flush=True)


def fit(sizes: list[int], cpu_s: list[float]) -> tuple[float, float]:
    """``(per_bucket_s, per_value_s)`` of the line through the two sizes' CPU per bucket (both >= 0)."""
    (n0, n1), (c0, c1) = sizes, cpu_s
    per_value = max(0.0, (c1 - c0) / (n1 - n0))
    return max(0.0, c0 - per_value * n0), per_value


def aggregator_cpu(trainers: int, reps: int = CALLS, timeout: float = 120.0) -> dict:
    """``{"trainers", "per_bucket_s", "per_value_s", "trainer_per_bucket_s", "trainer_per_value_s", "sizes",
    "cpu_s", "trainer_cpu_s"}`` for ``trainers`` trainers (module docstring)."""
    world = trainers + 1
    out = run_ranks("thinwire.measure.aggregator", ["--reps", str(reps), "--world", str(world)], timeout,
                    what="the switch aggregator's CPU probe", world=world, rank=trainers)
    result = json.loads(out.strip().splitlines()[-1])
    per_bucket, per_value = fit(result["sizes"], result["cpu_s"])
    own_bucket, own_value = fit(result["sizes"], result["trainer_cpu_s"])
    return {"trainers": trainers, "per_bucket_s": per_bucket, "per_value_s": per_value,
            "trainer_per_bucket_s": own_bucket, "trainer_per_value_s": own_value, **result}


def main(argv: list[str] | None = None) -> None:
    _rank(rank_args(argv, __doc__))


if __name__ == "__main__":
    main()
