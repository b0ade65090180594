"""``profile_workload``: measure everything the simulator needs on this machine, return a :class:`Profile`.

Steps: (1) the training step at each per-rank batch size, in DDP on one rank, with the bucket
layout and each bucket's readiness (:mod:`.compute`); (2) FLOPs and saved-activation bytes per
sample; (3) how fast the step runs when all cores are busy at once, and when up to twice as many
single-thread copies as cores time-share them (:mod:`.corun`), and the host CPU of a gloo all-reduce
per byte between two local ranks (:mod:`.collective`); (4) the codecs' encode/decode cost and the schemes' elementwise kernels at the workload's
bucket sizes (:mod:`.codec_costs`), and each codec's relative error with error feedback on the workload's
own gradients over a few steps (:func:`.codec_costs.ef_errors`); (5) with ``guard_steps``, the convergence
guard: each codec's sample factor against fp32 from short runs of the workload from its initial weights
(:mod:`.convergence`, what ``thinwire plan`` ranks by); each layer of the workload's layer list on its own
(:mod:`.layers`: what pipelines are split and priced by) and a stage's time per micro-batch beyond them
(:mod:`.pipeline_overhead`); (6) optionally the network's alpha and beta on a running emulated
cluster (:mod:`.network`). All timings use ``threads`` torch threads: the simulator's speed 1.

Example::

    prof = profile_workload(workload="charlm", batch_sizes=[8, 4], codecs=["none", "bf16"])
    save_profile(prof, "charlm.profile.yaml")
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Callable, Sequence

import torch

from thinwire.config import check, check_range
from thinwire.errors import ThinwireError, short
from thinwire.measure.codec_costs import ef_errors, measure_codecs, measure_kernels, measure_wire, sizes_for
from thinwire.measure.compute import StepTimer, activation_bytes, count_flops, single_process_group, step_gradients
from thinwire.measure.convergence import GUARD_EVERY, GUARD_STEPS, GUARD_WORLD, measure_convergence
from thinwire.measure.file import ComputePoint, Profile

EF_STEPS = 6  # training steps whose gradients each codec compresses in shadow (its error with error feedback)


CORUN_NOISE = 1.05  # n copies measured this much faster than their fair share: the solo timing was slowed


def corun_over_fair(speed: float, cores: int, n: int) -> float:
    """``n`` copies' speed (each, over one copy's alone) over their fair share ``min(1, cores / n)``, at most 1:
    copies that share the cores cannot outrun their share; a ratio above 1 says the copy timed alone ran on a
    busy machine (or before the clock rose), and kept, it would price co-located hosts faster than alone."""
    ratio = speed / min(1.0, cores / n)
    if ratio > CORUN_NOISE:
        print(f"thinwire: note: {n} copies of the step ran at {ratio:.2f} of their fair share, faster than one copy "
              "alone, so that copy's timing was slowed by other load on this machine; recorded as 1.00. Profile on an "
              "idle machine for a co-run factor to trust.", file=sys.stderr, flush=True)
    return min(ratio, 1.0)


def machine_info(threads: int) -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "torch": str(torch.__version__), "threads": threads}


def profile_workload(*, workload: str, model: dict | None = None, data: str | None = None, batch_sizes: list[int],
                     bucket_mb: float = 25.0, threads: int = 1, codecs: Sequence[str] | None = None, reps: int = 10,
                     warmup: int = 3, network=None, seed: int = 0, corun: bool = True, guard_steps: int = 0,
                     progress: Callable[[str], None] | None = None) -> Profile:
    """Measure ``workload`` at each per-rank batch size (see the module docstring). ``codecs``: the
    specs to measure (default: every registered codec at its default parameters); ``guard_steps``:
    steps of each convergence-guard run at the largest batch as the global batch (0: no guard);
    ``progress`` gets a line as each part ends (each of the guard's data orders, each co-run count)."""
    from thinwire.compress.spec import REGISTRY
    from thinwire.workloads.registry import build_workload

    codecs = REGISTRY.names() if codecs is None else list(codecs)

    check(bool(batch_sizes) and min(batch_sizes) >= 1, "--batch-sizes", batch_sizes, "positive integers")
    check_range("--threads", threads, 1, 1024, kind="an integer")
    check_range("--reps", reps, 2, 10**6, kind="an integer")
    check_range("--bucket-mb", bucket_mb, 0, 4096, open_lo=True, fix="DDP's default is 25.")
    check(guard_steps == 0 or guard_steps >= 2 * GUARD_EVERY, "--guard-steps", guard_steps,
          f"0 (no guard) or at least {2 * GUARD_EVERY} (two evaluations)", f"The default is {GUARD_STEPS}.")
    torch.set_num_threads(threads)
    runtime = _resident_bytes()  # before any model: what every worker process holds anyway
    clock = [time.perf_counter()]

    def done(what: str) -> None:  # a line per part, so minutes of measuring are never silent
        now = time.perf_counter()
        if progress is not None:
            progress(f"{what} in {now - clock[0]:.0f} s")
        clock[0] = now

    with single_process_group():
        torch.manual_seed(seed)
        wl = build_workload(workload, dict(model or {}), data)
        timer = StepTimer(wl, bucket_mb=bucket_mb, lr=wl.lr, seed=seed)
        points, buckets = [], []
        for b in sorted(set(batch_sizes), reverse=True):
            try:
                point, layout = timer.measure(b, warmup=warmup, reps=reps)
            except (MemoryError, RuntimeError) as e:  # the CPU allocator's "can't allocate memory", CUDA's OOM
                if not isinstance(e, MemoryError) and "allocate" not in str(e) and "out of memory" not in str(e):
                    raise
                fits = [x for x in batch_sizes if x < b]
                raise ThinwireError(f"--batch-sizes: a step at batch {b} does not fit in this machine's memory "
                                    f"({short(str(e).splitlines()[0], 200)}). Pass smaller sizes"
                                    + (f" (e.g. --batch-sizes {','.join(map(str, sorted(set(fits))))})." if fits else ".")
                                    ) from None
            points.append(point)
            buckets = buckets or layout
            done(f"step timed at batch {b} ({reps} repetitions)")
        b0 = points[0].batch
        grads = step_gradients(timer, b0, EF_STEPS) if codecs else []
        guard = {}
        if guard_steps and codecs:  # from the workload's initial weights, as a training run starts
            torch.manual_seed(seed)
            fresh = build_workload(workload, dict(model or {}), data)
            guard = measure_convergence(fresh, list(codecs), world=min(GUARD_WORLD, b0), batch=b0, steps=guard_steps,
                                        seed=seed, delayed=True, progress=progress)
            done("convergence guard")
        flops = count_flops(wl, b0) / b0
        acts = activation_bytes(wl, b0) / b0
        layer_costs = _layer_costs(wl, workload, b0, reps)
        if layer_costs:
            done(f"{len(layer_costs)} layers timed for pipelines")
    corun_speed = {}
    cores = os.cpu_count() or 1
    if corun and cores > 1:
        from thinwire.measure.corun import corun_speed as measure_corun

        # n concurrent copies of the step, each relative to its fair share min(1, cores/n) of one alone:
        # every core busy, and (one thread each) up to twice as many copies as cores, time-sharing them
        # as the hosts of an emulated cluster with more hosts than cores do
        for n in range(cores, 2 * cores + 1 if threads == 1 else cores + 1):
            speed = measure_corun(workload=workload, model=dict(model or {}), data=data, batch=b0,
                                  threads=threads, n=n)
            corun_speed[str(n)] = corun_over_fair(speed, cores, n)
            done(f"{n} copies of the step run at once (the co-running hosts' speed)")
    collective_cpu = 0.0
    if corun and cores > 1:  # two ranks, each on a core of its own
        from thinwire.measure.collective import collective_cpu as measure_collective

        collective_cpu = measure_collective()["per_byte_s"]
        done("a collective's CPU per byte measured")
    pipe_overhead, inter_overhead = 0.0, None
    if corun and cores > 1 and layer_costs:  # a pipeline stage's time per micro-batch beyond its layers
        from thinwire.measure.pipeline_overhead import pipeline_overhead

        got = pipeline_overhead()
        pipe_overhead, inter_overhead = got["per_microbatch_s"], got["interleaved_per_microbatch_s"]
        done("a pipeline stage's overhead per micro-batch measured")
    numels = [bk.numel for bk in buckets]
    sizes = sizes_for(numels)
    kernels = measure_kernels(sizes, reps)
    if layer_costs:  # the pipeline links' formats, at a cut's size of this batch
        cut = max(l.output_bytes for l in layer_costs) / 4 * b0
        kernels.update(measure_wire(max(l.width for l in layer_costs), int(cut), max(3, reps // 2)))
    done("kernels timed")
    costs = measure_codecs(list(codecs), numels, reps=max(3, reps // 2))
    if codecs:
        done(f"{len(codecs)} codecs timed")
    return Profile(
        workload=workload, model=dict(model or {}), data=data, threads=threads, bucket_mb=bucket_mb,
        parameters=sum(p.numel() for p in wl.model.parameters()), machine=machine_info(threads),
        compute=points, flops_per_sample=flops,
        achieved_flops=flops * b0 / (points[0].forward_s + points[0].backward_s),
        activation_bytes_per_sample=acts, buckets=buckets, corun_speed=corun_speed,
        collective_cpu_s_per_byte=collective_cpu, kernels=kernels,
        codecs=_with_errors(costs, list(codecs), grads, guard),
        sync={"delayed": guard["delayed"]} if "delayed" in guard else {},
        network=network, layers=layer_costs, layers_batch=b0 if layer_costs else 0, runtime_bytes=runtime,
        pipeline_overhead_s=pipe_overhead, interleaved_overhead_s=inter_overhead,
        val_items=len(wl.val) if wl.val is not None else 0)


def _resident_bytes() -> int:
    """This process's resident memory now (``/proc/self/status``; the peak where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _layer_costs(wl, workload: str, batch: int, reps: int) -> list:
    """Per-layer costs for pipelines, where the workload has a layer list (else none)."""
    from thinwire.errors import ThinwireError
    from thinwire.measure.layers import measure_layers
    from thinwire.pipeline.stages import layer_list

    try:
        layers = layer_list(wl.model, wl.layers, workload)
    except ThinwireError:
        return []
    return measure_layers(wl, layers, batch, reps=max(3, reps // 2))


def measure_compute(*, workload: str, model: dict | None = None, data: str | None = None, batch: int,
                    bucket_mb: float = 25.0, threads: int = 1, reps: int = 10, warmup: int = 3,
                    seed: int = 0) -> ComputePoint:
    """Step (1) of :func:`profile_workload` alone, at one per-rank batch: the training step's phases
    measured now (a few seconds), e.g. to follow a machine whose speed drifts between runs."""
    from thinwire.workloads.registry import build_workload

    check(batch >= 1, "batch", batch, "a positive integer")
    torch.set_num_threads(threads)
    with single_process_group():
        torch.manual_seed(seed)
        wl = build_workload(workload, dict(model or {}), data)
        point, _ = StepTimer(wl, bucket_mb=bucket_mb, lr=wl.lr, seed=seed).measure(batch, warmup=warmup, reps=reps)
    return point


def _with_errors(costs: dict, specs: list[str], grads: list, guard: dict) -> dict:
    """Each codec's measured cost with its error-feedback error on the workload's own gradients and
    its convergence guard's record."""
    import dataclasses

    errors = ef_errors(specs, grads) if grads else {}
    return {name: dataclasses.replace(cost, ef_error=errors.get(name), convergence=guard.get(name))
            for name, cost in costs.items()}
