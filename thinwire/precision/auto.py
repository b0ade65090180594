"""``precision: auto``: measure which precision trains this model fastest here, and check it is safe.

No table of "int8 is faster on X" survives contact with a new model or machine: whether int8 or
bf16 pays depends on the layer shapes (int8 matmuls win from about 256 wide on AVX-512 VNNI,
lose at 64) and on the hardware (bf16 is 2.2-2.6x faster than fp32 on a CPU with AVX512-BF16,
fp16 ~60x slower on one without fp16 units). So measure:

1. For each candidate (fp32, bf16, int8, and fp16 on CUDA), copy the model from the same initial
   weights and run ``steps`` real training steps (forward, backward, clip, optimizer) on the same
   batches with the same random stream. Candidates run in lockstep, step by step, so load from
   other processes hits them alike.
2. Speed: the median step time after ``warmup`` steps.
3. Loss parity (the shadow run): the mean training loss over the last half of the steps must be
   within ``tolerance`` (relative) of fp32's, and every loss finite.
4. Choose the fastest candidate that passes; it must beat fp32 by ``min_speedup`` to be worth the
   numeric change, so noise alone never picks a lower precision. Log and return the reason.

Cost: ``len(candidates) * steps`` extra training steps at start, on copies (the model itself is
not trained).

Example::

    choice = choose_precision(model, lambda i: batches[i], loss_fn, device=torch.device("cpu"))
    choice.mode, choice.reason
    ('bf16', 'bf16: 2.31x faster per step than fp32 (41.2 vs 95.3 ms), loss within 0.2% ...')
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

from thinwire.precision.convert import convert
from thinwire.precision.runner import PrecisionRunner

log = logging.getLogger("thinwire.precision")


@dataclasses.dataclass
class Trial:
    mode: str
    step_s: float
    losses: list[float]
    rel_loss_diff: float = 0.0
    passed: bool = True

    def as_dict(self) -> dict:
        return {"mode": self.mode, "median_step_s": self.step_s, "final_loss": self.losses[-1],
                "rel_loss_diff_vs_fp32": self.rel_loss_diff, "loss_parity": self.passed}


@dataclasses.dataclass
class PrecisionChoice:
    mode: str
    reason: str
    trials: list[Trial]

    def as_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "trials": [t.as_dict() for t in self.trials]}


def default_candidates(device: torch.device) -> tuple[str, ...]:
    return ("fp32", "bf16", "int8", "fp16") if device.type == "cuda" else ("fp32", "bf16", "int8")


def choose_precision(model: nn.Module, sample_batch_fn: Callable[[int], tuple], loss_fn: Callable, *,
                     device: torch.device, optimizer_fn: Callable | None = None,
                     candidates: Sequence[str] | None = None, steps: int = 8, warmup: int = 2,
                     tolerance: float = 0.02, min_speedup: float = 1.05, clip: float | None = 1.0,
                     seed: int = 0, int8_options: dict | None = None) -> PrecisionChoice:
    """Time and shadow-train each candidate precision; return the choice and why (steps above)."""
    if steps < warmup + 2:
        raise ValueError(f"choose_precision: steps must be >= warmup + 2 ({warmup + 2}), got {steps}")
    optimizer_fn = optimizer_fn or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    batches = [sample_batch_fn(i) for i in range(steps)]
    modes = list(candidates or default_candidates(device))
    if "fp32" not in modes:
        modes.insert(0, "fp32")
    trials = _run_trials(model, modes, batches, loss_fn, optimizer_fn, device, warmup, clip, seed, int8_options or {})
    choice = _decide(trials, tolerance, min_speedup, steps)
    log.info("precision auto: %s", choice.reason)
    return choice


def _run_trials(model, modes, batches, loss_fn, optimizer_fn, device, warmup, clip, seed, int8_options) -> list[Trial]:
    """All candidates step in lockstep (step i of each, then step i + 1), so a burst of load from
    elsewhere on the machine slows every candidate alike instead of one of them."""
    runs = [_Shadow(model, m, optimizer_fn, device, int8_options) for m in modes]
    for i, (x, y) in enumerate(batches):
        for run in runs:
            torch.manual_seed(seed + i)  # same dropout / rounding stream for every candidate
            run.step(x, y, loss_fn, clip)
    return [Trial(r.mode, statistics.median(r.times[warmup:]), r.losses) for r in runs]


class _Shadow:
    """One candidate: its own copy of the model (same initial weights), optimizer and runner."""

    def __init__(self, model, mode, optimizer_fn, device, int8_options) -> None:
        self.mode, self.model = mode, copy.deepcopy(model)
        if mode == "int8":
            convert(self.model, "int8", **int8_options, quiet=True)  # a trial's copy: the run's model is not converted
        self.runner = PrecisionRunner(mode, device)
        self.opt = optimizer_fn(self.model.parameters())
        self.losses: list[float] = []
        self.times: list[float] = []

    def step(self, x, y, loss_fn, clip) -> None:
        t0 = time.perf_counter()
        with self.runner.context():
            loss = loss_fn(self.model(x), y)
        self.runner.backward(loss)
        self.runner.step(self.opt, clip=clip)
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())  # syncs the device, so the time is complete
        self.times.append(time.perf_counter() - t0)


def _decide(trials: list[Trial], tolerance: float, min_speedup: float, steps: int) -> PrecisionChoice:
    ref = next(t for t in trials if t.mode == "fp32")
    tail = slice(len(ref.losses) // 2, None)
    ref_loss = statistics.fmean(ref.losses[tail])
    for t in trials:
        mean = statistics.fmean(t.losses[tail])
        t.rel_loss_diff = abs(mean - ref_loss) / abs(ref_loss) if math.isfinite(mean) else math.inf
        t.passed = t.rel_loss_diff <= tolerance and all(math.isfinite(v) for v in t.losses)
    fast = [t for t in trials if t.passed and t is not ref and ref.step_s / t.step_s >= min_speedup]
    best = min(fast, key=lambda t: t.step_s, default=ref)
    parts = [f"{t.mode} {ref.step_s / t.step_s:.2f}x, loss {t.rel_loss_diff:.1%} off"
             + ("" if t.passed else " (fails parity)") for t in trials if t is not ref]
    if best is ref:
        head = f"fp32: no candidate both kept the loss within {tolerance:.0%} of fp32 and was {min_speedup:.2f}x faster"
    else:
        head = (f"{best.mode}: {ref.step_s / best.step_s:.2f}x faster per step than fp32 "
                f"({best.step_s * 1e3:.1f} vs {ref.step_s * 1e3:.1f} ms), loss within {best.rel_loss_diff:.1%} "
                f"of fp32 over {steps} shadow steps")
    return PrecisionChoice(best.mode, f"{head} [{'; '.join(parts)}]", trials)
