"""Measure what a pipeline stage spends per micro-batch beyond its layers' compute: the schedule's
bookkeeping and the point-to-point sends and receives of an activation and its gradient, at speed 1.

Two processes on this machine (one thread each, gloo over loopback) run a 2-stage pipeline of one tiny
layer each (``torch.distributed.pipelining``'s 1F1B) at M = 4 and M = 16 micro-batches; each rep after a
barrier, the slower rank's step, the median of ``reps`` kept (as the profile's compute times are: a run's
step is a typical one; the fastest of 5, kept before, read 0.35-0.75 ms per micro-batch from one profile
to the next, 2026-12-06, while the pipelines those profiles priced stepped 2-27% slower than predicted).
The layers' compute is negligible and loopback has no wire to speak of, so the step grows by one stage's
per-micro-batch overhead for each micro-batch added: ``overhead = (t16 - t4) / 12`` (its forward and
backward actions, one send and one receive each way). The model adds it to every stage's compute per
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

MICROBATCHES = (4, 16)


def _rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, WORLD), rank=args.rank, world_size=WORLD)
    loss = lambda out, y: out.square().mean()  # noqa: E731
    try:
        steps: dict[str, list[float]] = {"1f1b": [], "interleaved": []}
        for m in MICROBATCHES:
            stage = PipelineStage(torch.nn.Linear(8, 8), args.rank, WORLD, torch.device("cpu"))
            steps["1f1b"].append(_median_step(args, Schedule1F1B(stage, n_microbatches=m, loss_fn=loss), m,
                                           last=args.rank == WORLD - 1))
            stages = [PipelineStage(torch.nn.Linear(8, 8), args.rank + v * WORLD, 2 * WORLD, torch.device("cpu"))
                      for v in range(2)]
            steps["interleaved"].append(_median_step(args, ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss),
                                                  m, last=args.rank == WORLD - 1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if args.rank == 0:
        print(json.dumps({"microbatches": list(MICROBATCHES), "times_s": steps["1f1b"],
                          "interleaved_times_s": steps["interleaved"]}), flush=True)


def _median_step(args, sched, m: int, *, last: bool) -> float:
    """The median of ``args.reps`` steps (the slower rank's), after two warm-ups (shape inference, connections)."""
    import torch
    import torch.distributed as dist

    x, y = torch.randn(m, 8), torch.zeros(m, 8)
    times = []
    for i in range(args.reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        sched.step(*((x,) if args.rank == 0 else ()), target=y if last else None)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i >= 2:
            times.append(dt.item())
    return statistics.median(times)


def per_microbatch(microbatches: list[int], times: list[float]) -> float:
    """Seconds one stage spends per micro-batch beyond compute, from the two steps (module docstring)."""
    (m0, m1), (t0, t1) = microbatches, times
    return max(0.0, (t1 - t0) / (m1 - m0))


def pipeline_overhead(reps: int = 9, timeout: float = 120.0) -> dict:
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
