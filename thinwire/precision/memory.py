"""A memory budget for training: the largest micro-batch that fits, accumulated to the full batch.

What counts: the bytes of live tensors of one training step (parameters, gradients, optimizer
state, activations saved for backward and temporaries, and what DDP adds: its gradient buckets
and a transient copy in backward, two more copies of the gradients), measured, not modelled:

* CUDA: ``torch.cuda.max_memory_allocated`` around the step (it also counts whatever else is on
  the device, e.g. the model the copy was made from: an overestimate, so on the safe side).
* CPU: PyTorch keeps no allocator statistics, so :class:`LiveTensorBytes` (a
  ``__torch_dispatch__`` mode) follows every tensor storage created during the step, plus the
  model, optimizer and inputs that exist before it. Python objects and the framework's own
  libraries are not tensors and do not count.

Planning (Mandheling's batch splitting, Melon's micro-batching;
https://arxiv.org/abs/2206.07509):

1. Measure the peak of a step of two micro-batches (accumulation keeps gradients alive during the
   second forward) at micro-batch 1 and at ``m2 = max(2, batch // 2)``, on a copy of the model
   and a fresh optimizer whose state already exists (as in every step after the first).
2. Fit ``peak(m) = a + c * m`` through the two points; take the largest ``m <= batch`` with
   ``c * m <= (1 - margin) * (budget - a)``.
3. Split the batch evenly into ``ceil(batch / m)`` micro-batches and measure that exact step; if
   it is over budget, shrink ``m`` and measure again.
4. If micro-batch 1 is over budget, recompute activations in backward
   (``torch.utils.checkpoint`` on each repeated block) and plan again; if even that is over, raise
   :class:`~thinwire.errors.ThinwireError` saying how much memory one sample needs.

Cost: four to six extra training steps at start (the measured ones are 1.5-3x slower on CPU).

Example::

    plan = plan_memory(model, budget=parse_size("512MiB"), batch=32, sample=sample, loss_fn=loss_fn,
                       optimizer_fn=lambda ps: torch.optim.AdamW(ps), device=torch.device("cpu"))
    plan.micro_sizes          # e.g. [11, 11, 10]: accumulate three micro-batches per step
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref
from typing import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from thinwire import batch as B
from thinwire.errors import ThinwireError
from thinwire.precision.int8 import DITHER
from thinwire.units import parse_size  # noqa: F401  (the one size parser, re-exported for precision's users)

def format_bytes(n: float, up: bool = False) -> str:
    """``n`` bytes in the largest unit, one decimal; ``up``: rounded up (a minimum never reads below itself)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{math.ceil(n / size * 10) / 10 if up else n / size:.1f} {unit}"
    return f"{math.ceil(n) if up else int(n)} B"


# -- measuring -------------------------------------------------------------------------------------
class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storages, followed op by op (CPU; no allocator stats there).

    Every tensor an operator returns is looked at once per storage: its bytes are added, and a weak
    reference to the storage subtracts them when PyTorch frees it. ``external`` tensors (and the
    parameters, gradients, buffers and optimizer state of external modules and optimizers) count
    from the start. Storages shared by views count once.

    A freed storage's callback is ``list.append`` (C, no Python code): a stop signal's handler raises only in
    Python code, and one raised inside a weakref callback is printed and dropped (a Ctrl-C lost). The frees
    are subtracted before the next storage is added, so the peak is the same.
    """

    def __init__(self, *external) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: dict[int, list] = {}        # storage pointer -> [weak ref, bytes]
        self._by_ref: dict[int, tuple] = {}     # id(weak ref) -> (storage pointer, its entry)
        self._freed: list = []                  # weak refs of storages freed since the last look
        for t in _tensors_of(external):
            self._track(t)

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._seen.clear()  # drops the weak references, so nothing calls back into this object later
        self._by_ref.clear()
        self._freed.clear()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._track(t)
        return out

    def _track(self, t: Tensor) -> None:
        if t.device.type == "meta" or t.is_sparse:
            return
        self._subtract_freed()
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if n == 0:
            return
        entry = self._seen.get(key)
        if entry is not None:
            self.live += n - entry[1]  # resized in place
            entry[1] = n
        else:
            entry = self._seen[key] = [weakref.ref(st, self._freed.append), n]
            self._by_ref[id(entry[0])] = (key, entry)
            self.live += n
        self.peak = max(self.peak, self.live)

    def _subtract_freed(self) -> None:
        while self._freed:
            key, entry = self._by_ref.pop(id(self._freed.pop()))
            if self._seen.get(key) is entry:
                del self._seen[key]
            self.live -= entry[1]


def _tensors_of(objs) -> list[Tensor]:
    out = []
    for obj in objs:
        if isinstance(obj, Tensor):
            out.append(obj)
        elif isinstance(obj, nn.Module):
            out += [*obj.parameters(), *obj.buffers(), *(p.grad for p in obj.parameters() if p.grad is not None)]
        elif isinstance(obj, torch.optim.Optimizer):
            out += [v for state in obj.state.values() for v in state.values() if isinstance(v, Tensor)]
    return out


class PeakMemory:
    """Peak bytes of live tensors while the ``with`` block runs (see the module docstring).

    ``external``: modules, optimizers and tensors that exist before the block and count toward
    it on CPU; on CUDA everything allocated on the device counts.
    """

    def __init__(self, device: torch.device, *external) -> None:
        self.device, self.external, self.peak = torch.device(device), external, 0
        self._mode = None

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = LiveTensorBytes(*self.external).__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._mode.__exit__(*exc)
            self.peak = self._mode.peak


StepFn = Callable[[Sequence[int]], int]  # micro-batch sizes -> measured peak bytes of one step


def step_peak(model: nn.Module, micro_sizes: Sequence[int], *, sample: Callable[[int], tuple[Tensor, Tensor]],
              loss_fn: Callable, optimizer_fn: Callable, device: torch.device, context=None,
              extra_bytes: int = 0) -> int:
    """Measured peak bytes of one accumulated step over ``micro_sizes`` on a copy of ``model``."""
    m = copy.deepcopy(model)
    opt = optimizer_fn(m.parameters())
    _create_optimizer_state(m, opt)
    x, y = sample(sum(micro_sizes))  # one batch, split into views, as the training loop does
    with PeakMemory(device, m, opt, *B.tensors(x), *B.tensors(y), *DITHER.tensors()) as meter:
        for xm, ym in zip(B.split(x, list(micro_sizes)), B.split(y, list(micro_sizes))):
            with context() if context else contextlib.nullcontext():
                loss = loss_fn(m(xm), ym) * (B.batch_len(ym) / B.batch_len(y))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return meter.peak + extra_bytes


def _create_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One step on zero gradients, so state (Adam's moments) exists as in every later step."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of one copy of every gradient. DDP holds one in its flat buckets (allocated when it
    wraps the model), makes one more, transiently, in backward (measured, with and without a comm
    hook), and once, at the start of its second iteration, rebuilds its buckets in gradient-ready
    order, allocating the new flat buckets while the old ones still exist (measured: the run's
    second step peaked one gradient copy above the plan made with two; int8 with activation
    checkpointing under a 24 MiB budget went to 25.0 MiB). So a plan made without DDP adds three of
    these. Buffers a codec allocates on thinwire's communication thread are not included."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# -- planning --------------------------------------------------------------------------------------
@dataclasses.dataclass
class MemoryPlan:
    budget_bytes: int
    batch: int
    micro_sizes: list[int]
    checkpointing: bool
    measured_peak_bytes: int
    fit: tuple[float, float]  # peak(m) ~ fit[0] + fit[1] * m bytes
    checkpointed: list[str] = dataclasses.field(default_factory=list)

    @property
    def micro_batch(self) -> int:
        return max(self.micro_sizes)

    def as_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "batch": self.batch, "micro_batch": self.micro_batch,
                "accumulation_steps": len(self.micro_sizes), "micro_sizes": self.micro_sizes,
                "activation_checkpointing": self.checkpointing, "checkpointed_modules": self.checkpointed,
                "planned_peak_bytes": self.measured_peak_bytes,
                "fit_bytes": {"fixed": round(self.fit[0]), "per_sample": round(self.fit[1])}}


def split_evenly(batch: int, max_micro: int, min_micro: int = 1) -> list[int]:
    """``batch`` into the fewest micro-batches of at most ``max_micro``, sizes differing by <= 1, none under
    ``min_micro`` (a model that cannot train on fewer samples, as BatchNorm on one)."""
    n = min(math.ceil(batch / max(1, max_micro)), max(1, batch // max(1, min_micro)))
    return [batch // n + (1 if i < batch % n else 0) for i in range(n)]


def search_micro_batch(batch: int, budget: int, measure: StepFn, *, margin: float = 0.05,
                       retries: int = 4, smallest: int = 1) -> MemoryPlan | None:
    """Largest micro-batch whose measured step peak is within ``budget``; None if ``smallest`` is over it."""
    low = min(smallest, batch)
    p1 = measure(_smallest_step(batch, low))
    if p1 > budget:
        return None
    if batch <= low:
        return MemoryPlan(budget, batch, [batch], False, p1, (p1, 0.0))
    m2 = max(low + 1, batch // 2)
    p2 = measure([m2, m2])
    per = max(0.0, (p2 - p1) / (m2 - low))
    fixed = p1 - per * low
    micro = batch if per == 0 else int((budget - fixed) * (1 - margin) // per)
    micro = min(batch, max(low, micro))
    for _ in range(retries):
        sizes = split_evenly(batch, micro, low)
        peak = measure(sizes)
        if peak <= budget:
            return MemoryPlan(budget, batch, sizes, False, peak, (fixed, per))
        if micro == low:
            return None
        micro = max(low, min(micro - 1, int(micro * budget / peak * (1 - margin))))
    # still over after the retries: the smallest micro-batches, which fit (a step of them peaks as the
    # two-micro-batch step measured first: accumulation keeps only the gradients)
    return MemoryPlan(budget, batch, split_evenly(batch, low, low), False, p1, (fixed, per))


def _smallest_step(batch: int, smallest: int) -> list[int]:
    """The step the search measures first: two micro-batches of ``smallest`` (accumulation), or the batch."""
    return [smallest, smallest] if batch >= 2 * smallest else [batch]


def apply_checkpointing(model: nn.Module) -> list[str]:
    """Recompute activations in backward for each repeated block (children of ``nn.ModuleList``,
    else the top-level children with parameters). Saves their inner activations for one more
    forward of compute. In place; returns the names of the wrapped modules."""
    names = [f"{parent}.{child}" if parent else child for parent, mod in model.named_modules()
             if isinstance(mod, nn.ModuleList) for child, _ in mod.named_children()]
    if not names:
        names = [n for n, c in model.named_children() if any(True for _ in c.parameters())]
    for name in names:
        sub = model.get_submodule(name)
        if not isinstance(sub.forward, _Checkpointed):
            sub.forward = _Checkpointed(sub.forward)
    return names


class _Checkpointed:
    """A module's forward run through ``torch.utils.checkpoint`` when gradients are on."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return self.forward(*args, **kwargs)


def plan_memory(model: nn.Module, *, budget: int, batch: int, budget_text: str | None = None,
                checkpoint_fallback: bool = True, **step_kwargs) -> MemoryPlan:
    """Plan micro-batches for ``model`` under ``budget`` bytes (steps in the module docstring).

    ``step_kwargs`` go to :func:`step_peak` (``sample``, ``loss_fn``, ``optimizer_fn``, ``device``,
    ``context``, ``extra_bytes``). May turn on activation checkpointing in ``model`` itself.
    """
    peaks: dict[tuple, int] = {}  # the refusal names the very peak the search compared, not a new measurement

    def measure(sizes) -> int:
        if tuple(sizes) not in peaks:
            peaks[tuple(sizes)] = step_peak(model, sizes, **step_kwargs)
        return peaks[tuple(sizes)]

    smallest = _smallest_micro(measure, batch)
    plan = search_micro_batch(batch, budget, measure, smallest=smallest)
    if plan is not None or not checkpoint_fallback:
        return plan if plan is not None else _refuse(budget, budget_text, _floor(measure, batch, smallest), False,
                                                     smallest)
    wrapped = apply_checkpointing(model)
    peaks.clear()  # another model now
    plan = search_micro_batch(batch, budget, measure, smallest=smallest)
    if plan is None:
        _refuse(budget, budget_text, _floor(measure, batch, smallest), True, smallest)
    plan.checkpointing, plan.checkpointed = True, wrapped
    return plan


def _floor(measure: StepFn, batch: int, smallest: int) -> int:
    """The least a step needs: the larger of the two smallest steps the search measures (two micro-batches of
    ``smallest``; the batch in micro-batches of ``smallest``, where an odd one out is larger), as measured."""
    return max(measure(_smallest_step(batch, smallest)), measure(split_evenly(batch, smallest, smallest)))


def _smallest_micro(measure: StepFn, batch: int) -> int:
    """1, or 2 for a model that cannot train on one sample (BatchNorm: "Expected more than 1 value per
    channel when training"); an error at two samples too is the model's, said in one line."""
    for size in (1, 2):
        if size > 1 and batch < 2 * size:
            break
        try:
            measure(_smallest_step(batch, size))
            return size
        except (RuntimeError, ValueError) as e:
            error = e
    raise ThinwireError(f"memory_budget: the model's training step failed on micro-batches of one and two samples, "
                        f"which the budget's plan measures: {type(error).__name__}: {error}. Train without "
                        "--memory-budget, or make the model take small batches.")


def _refuse(budget: int, text: str | None, smallest_peak: int, checkpointed: bool, smallest: int = 1):
    how = "with activation checkpointing" if checkpointed else "without activation checkpointing"
    one = "one sample" if smallest == 1 else f"{smallest} samples (the model cannot train on one)"
    need = max(smallest_peak, budget + 1)  # the peak the search compared: above the budget it refuses
    raise ThinwireError(
        f"memory_budget: must be at least {format_bytes(need, up=True)} for this model (the measured peak of a "
        f"training step on micro-batches of {one} {how}), got {text or format_bytes(budget)} ({budget} bytes). "
        f"Raise --memory-budget to {format_bytes(math.ceil(need * 1.1), up=True)} or more (10% above it, for what the "
        "measurement does not see), or use a smaller model.")
