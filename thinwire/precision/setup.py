"""The trainer's one call into precision/: resolve ``auto``, convert, plan memory, report.

:func:`prepare_precision` runs after the model is built and before DDP wraps it:

1. ``auto``: rank 0 measures the candidates (:func:`~thinwire.precision.auto.choose_precision`)
   and broadcasts its choice, so every rank trains the same way.
2. ``int8``: swap the layers (:func:`~thinwire.precision.convert.convert`). bf16/fp16 live in the
   :class:`~thinwire.precision.runner.PrecisionRunner` (autocast, loss scaling).
3. ``memory_budget``: rank 0 plans micro-batches (:func:`~thinwire.precision.memory.plan_memory`),
   counting DDP's gradient buckets, and broadcasts the plan (or the refusal).

The returned :class:`PrecisionSetup` holds the runner, the micro-batch sizes to accumulate over
and a ``measure`` context that records the peak memory of the first steps for the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from thinwire import batch as B
from thinwire.errors import ThinwireError
from thinwire.precision.auto import PrecisionChoice, choose_precision
from thinwire.precision.convert import conversion_report, convert
from thinwire.precision.int8 import COUNTERS, DITHER
from thinwire.precision.quant import reset_counters
from thinwire.precision.memory import (MemoryPlan, PeakMemory, apply_checkpointing, gradient_bytes, parse_size,
                                       plan_memory)
from thinwire.precision.runner import PrecisionRunner

log = logging.getLogger("thinwire.precision")

# sample(n, i) -> (inputs, targets): the i-th batch of n training samples, on the device
SampleFn = Callable[[int, int], tuple]


@dataclasses.dataclass
class PrecisionSetup:
    requested: str
    mode: str
    runner: PrecisionRunner
    micro_sizes: list[int]
    device: torch.device
    model: nn.Module
    extra_bytes: int = 0  # tensors that exist before a step and that the model does not hold (DDP buckets)
    plan: MemoryPlan | None = None
    choice: PrecisionChoice | None = None
    measured_steps: int = 2
    step_peaks: list[int] = dataclasses.field(default_factory=list)

    def measure(self, optimizer: torch.optim.Optimizer, *inputs):
        """Wrap a training step: the first ``measured_steps`` steps record their peak tensor bytes.

        Later steps repeat the same shapes, so they peak the same. On CUDA the allocator tracks the
        whole run and this is a no-op.
        """
        if self.device.type == "cuda" or len(self.step_peaks) >= self.measured_steps:
            return contextlib.nullcontext()
        return self._recorded(PeakMemory(self.device, self.model, optimizer, *inputs, *DITHER.tensors()))

    @contextlib.contextmanager
    def _recorded(self, meter: PeakMemory):
        with meter:
            yield
        self.step_peaks.append(meter.peak + self.extra_bytes)

    def int8_state(self) -> dict | None:
        """int8 compute's process-wide state (its rounding noise, its matmul counts) for a rank's checkpoint."""
        if self.mode != "int8":
            return None
        return {"dither": DITHER.state_dict(), "counters": {"int8": COUNTERS.int8, "float": COUNTERS.float}}

    def load_int8_state(self, sd: dict | None) -> None:
        if self.mode == "int8" and sd:
            DITHER.load_state_dict(sd["dither"])
            COUNTERS.int8, COUNTERS.float = int(sd["counters"]["int8"]), int(sd["counters"]["float"])

    def peak_memory_bytes(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return max(self.step_peaks) if self.step_peaks else None

    def report(self) -> dict:
        out = {"requested": self.requested, **self.runner.report(), "mode": self.mode,
               "micro_sizes": self.micro_sizes}
        if self.mode == "int8":
            out.update(conversion=conversion_report(self.model), **COUNTERS.as_dict())
        if self.choice is not None:
            out["auto"] = self.choice.as_dict()
        if self.plan is not None:
            out["memory_plan"] = self.plan.as_dict()
        peak = self.peak_memory_bytes()
        if peak is not None:
            out["peak_memory_bytes"] = peak
            out["peak_memory_method"] = ("torch.cuda.max_memory_allocated" if self.device.type == "cuda" else
                                         f"live tensor bytes, first {len(self.step_peaks)} steps, + DDP buckets")
        return out


def prepare_precision(model: nn.Module, mode: str, *, device: torch.device, batch: int, sample: SampleFn,
                      loss_fn: Callable, optimizer_fn: Callable, memory_budget: str | None = None,
                      ddp: bool = True, int8_options: dict | None = None, clip: float | None = 1.0) -> PrecisionSetup:
    """Resolve, convert and plan (module docstring); ``batch`` is this rank's share of the global batch."""
    int8_options = int8_options or {}
    choice = None
    if mode == "auto":
        choice = _on_rank0(lambda: choose_precision(model, lambda i: sample(batch, i), loss_fn, device=device,
                                                    optimizer_fn=optimizer_fn, clip=clip, int8_options=int8_options))
    resolved = choice.mode if choice is not None else mode
    if choice is not None and resolved != "int8":  # the trial's int8 noise buffer and counts are not this run's:
        DITHER.reset()                               # kept, they counted in its memory plan and its peak
        reset_counters()
    if resolved == "int8":
        convert(model, "int8", **int8_options)
    if resolved == "fp16" and device.type == "cpu":
        log.warning("precision fp16 on CPU: autocast runs fp16 without hardware support here (measured ~60x "
                    "slower than fp32 on AVX-512 without FP16); bf16 is the fast 16-bit format on CPUs")
    runner = PrecisionRunner(resolved, device)
    buckets = gradient_bytes(model) if ddp else 0  # DDP's buckets exist before every step
    setup = PrecisionSetup(mode, resolved, runner, [batch], device, model, extra_bytes=buckets, choice=choice)
    if memory_budget is not None:
        setup.plan = _on_rank0(lambda: plan_memory(
            model, budget=parse_size(memory_budget), budget_text=memory_budget, batch=batch,
            sample=lambda n: sample(n, 0), loss_fn=loss_fn, optimizer_fn=optimizer_fn, device=device,
            context=runner.context, extra_bytes=3 * buckets))  # + DDP's copy in backward and its one bucket
            # rebuild: the plan runs without DDP (memory.gradient_bytes)
        if setup.plan.checkpointing:
            apply_checkpointing(model)  # no-op on rank 0, which planned on this very model
        setup.micro_sizes = setup.plan.micro_sizes
    if device.type == "cuda":  # the run's peak starts here, not with the measurements above
        torch.cuda.reset_peak_memory_stats(device)
    return setup


def _on_rank0(fn: Callable):
    """``fn()`` on rank 0, its result (or its ThinwireError) on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except ThinwireError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ThinwireError(value)
    return value


def sample_from(dataset, collate: Callable, device: torch.device, seed: int = 0) -> SampleFn:
    """A :data:`SampleFn` over ``dataset``: batch ``i`` is ``n`` seeded random items, moved to ``device``."""
    def sample(n: int, i: int = 0) -> tuple:
        g = torch.Generator().manual_seed(seed * 7919 + i)
        x, y = collate(dataset, torch.randint(0, len(dataset), (n,), generator=g).tolist())
        return B.to(x, device), B.to(y, device)

    return sample
