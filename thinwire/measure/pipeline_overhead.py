"""Measure what a pipeline stage spends per micro-batch beyond its layers' compute: the schedule's
bookkeeping and the point-to-point sends and receives of an activation and its gradient, at speed 1.

Two processes on this machine (one thread each, gloo over loopback) run a 2-stage pipeline of one tiny
layer each (``torch.distributed.pipelining``'s 1F1B) at M = 4 and M = 32 micro-batches, each step after a
barrier, the slower rank's time. The layers' compute is negligible and loopback has no wire to speak of, so
the step grows by one stage's per-micro-batch overhead for each micro-batch added: ``overhead = (t32 - t4) /
28`` (its forward and backward actions, one send and one receive each way), the median over ``reps`` pairs,
each pair's two steps taken one right after the other (this machine's speed drifts by the minute: the
medians of 9 steps of each M, taken M after M, read 0.29-0.89 ms from one profile to the next on
2026-12-06, the fastest of 5 before them 0.35-0.75 ms). Eight probes of each, alternated on a quiet
machine (2026-12-06 17:40 UTC): 0.25-0.93 ms (median 0.41) taken M after M, 0.44-0.63 ms (median 0.55)
in pairs; interleaved 3.3-4.9 and 3.5-4.4 ms. The model adds it to every stage's compute per
micro-batch, over the host's speed (:mod:`thinwire.sim.pipeline`).

The same for the interleaved schedule (``ScheduleInterleaved1F1B``, 2 tiny stages per rank): a rank's
overhead per micro-batch, both its stages. It is not twice 1F1B's: each of a rank's 6 sends and receives
per micro-batch cost 0.23 ms to post in torch's multi-stage runtime here, against 0.07-0.15 ms for 1F1B's
2 (measured 2026-12-05 with the posts timed inside a step; 10-30 us each when posted alone), and a
trivial 2-rank step grew by 3.1 ms per micro-batch where 1F1B's grew by 0.56 ms.

Run as a module it is one rank: ``python -m thinwire.measure.pipeline_overhead --rank R ...``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from thinwire.measure.collective import WORLD, rank_args, run_ranks

MICROBATCHES = (4, 32)
WARMUP = 2  # steps of each schedule left out: shape inference, connections


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, WORLD), rank=args.rank, world_size=WORLD)
    loss = lambda out, y: out.square().mean()  # noqa: E731
    last = args.rank == WORLD - 1
    try:
        scheds: dict[str, list] = {"1f1b": [], "interleaved": []}
        for m in MICROBATCHES:
            stage = PipelineStage(torch.nn.Linear(8, 8), args.rank, WORLD, torch.device("cpu"))
            scheds["1f1b"].append(Schedule1F1B(stage, n_microbatches=m, loss_fn=loss))
            stages = [PipelineStage(torch.nn.Linear(8, 8), args.rank + v * WORLD, 2 * WORLD, torch.device("cpu"))
                      for v in range(2)]
            scheds["interleaved"].append(ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss))
        steps = {kind: [[_step(args, s, m, last) for s, m in zip(pair, MICROBATCHES)] for _ in range(args.reps + WARMUP)]
                 for kind, pair in scheds.items()}  # rep by rep: each rep's two steps back to back
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps({"microbatches": list(MICROBATCHES), "times_s": steps["1f1b"][WARMUP:],
                          "interleaved_times_s": steps["interleaved"][WARMUP:]}), flush=True)


def _step(args, sched, m: int, last: bool) -> float:
    """One step's seconds, the slower rank's, after a barrier."""
    import torch
    import torch.distributed as dist

    x, y = torch.randn(m, 8), torch.zeros(m, 8)
    dist.barrier()
    t0 = time.perf_counter()
    sched.step(*((x,) if args.rank == 0 else ()), target=y if last else None)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def per_microbatch(microbatches: list[int], pairs: list[list[float]]) -> float:
    """Seconds one stage spends per micro-batch beyond compute: the median over the reps of each rep's two steps'
    difference per micro-batch added (module docstring).

    >>> per_microbatch([4, 32], [[0.010, 0.024], [0.012, 0.025], [0.011, 0.040]])  # the third rep drifted
    0.0005
    """
    m0, m1 = microbatches
    return max(0.0, statistics.median((t1 - t0) / (m1 - m0) for t0, t1 in pairs))


def pipeline_overhead(reps: int = 15, timeout: float = 120.0) -> dict:
    """``{"per_microbatch_s", "interleaved_per_microbatch_s", "microbatches", "times_s", "interleaved_times_s"}``
    (module docstring)."""
    out = run_ranks("thinwire.measure.pipeline_overhead", ["--reps", str(reps)], timeout,
                   what="the pipeline overhead probe")
    result = json.loads(out.strip().splitlines()[-1])
    return {"per_microbatch_s": per_microbatch(result["microbatches"], result["times_s"]),
            "interleaved_per_microbatch_s": per_microbatch(result["microbatches"], result["interleaved_times_s"]),
            **result}


def main(argv: list[str] | None = None) -> None:
    _rank(rank_args(argv, __doc__))


if __name__ == "__main__":
    main()
