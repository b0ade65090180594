"""``delayed``: one-step-stale gradient averaging, so communication overlaps the next step's compute.

Pipe-SGD (Li et al., NeurIPS 2018, https://arxiv.org/abs/1811.03619) with staleness K=1:

1. backward fills each rank's *local* gradients (DDP's all-reduce is skipped: ``no_sync``);
2. ``before_step`` copies them into flat buckets and starts averaging them through the codec and
   error feedback of the :class:`~thinwire.compress.hook.CommState` (on its communication thread or
   as asynchronous all-reduces), then waits for the *previous* step's averages and puts them in the
   parameters' ``.grad``: the optimizer at step t+1 applies the averaged gradient of step t;
3. at the first step nothing has been averaged yet: the gradients are cleared and the optimizer
   applies nothing (Pipe-SGD's pipeline fill; every rank keeps identical parameters, which applying
   the local gradient, as Delayed Gradient Averaging does with a correction term, would not).

**Weight prediction** (``predict=own``, the default): a stale gradient is computed at ``w_t`` and applied
to ``w_{t+1}``. With an adaptive optimizer at the learning rates small models train at, that one step
costs much: charlm (2 layers, width 128) on 4 workers, 480 steps, ended 48% above DDP fp32's validation
loss (in one-process runs, with AdamW's momentum off or at a fifth of the learning rate, no better).
So each step's forward and backward run at the weights the gradient will be applied to, predicted.
``w_{t+1} = w_t - U(avg g_{t-1})`` is not known while step t+1 computes (``avg g_{t-1}`` is in flight), but
this rank's own ``g_{t-1}`` is, an unbiased estimate of the average from a quarter of its samples on 4
ranks: the prediction is the optimizer's step from ``w_t`` with that own gradient (clipped as the trainer
clips), taken on a copy of the optimizer's state, which stays untouched (:func:`preview_step`; the
delay compensation of Delayed Gradient Averaging, Zhu et al., NeurIPS 2021, https://openreview.net/forum?id=ACFHNxVNvfk,
which applies the local gradient at once, but here only to choose where the gradient is computed: the
weights the optimizer keeps are moved by averaged gradients only, so every rank holds the same ones).
Repeating the last update misses how the next one differs from it; a rank's own gradient carries that
difference, up to its sampling noise, which is what is left of the error.
``predict=last`` repeats the last update, ``w_t + (w_t - w_{t-1})`` (SpecTrain, Chen et al. 2018,
https://arxiv.org/abs/1809.02839; PipeMare, Yang et al. 2021); ``own`` falls back to it while the mode has
not been told the optimizer (``mode.step(optimizer)``, the trainers and the integrations tell it);
``predict=off`` gives Pipe-SGD's plain staleness. Measured (``benchmarks/results/delayed_predict.md``,
4 workers, full runs, 3 seeds): ``own`` ends within 1% of DDP fp32's loss on a GRU language model, the
digits classifier and a denoiser (``last``: +49% on the denoiser), charlm +22% (``last`` +34%, ``off`` +48%).
The parameters move to the predicted point on the first training forward of a step (a forward
pre-hook on the model: a forward in ``eval()`` mode or under ``no_grad`` leaves them) and are put back
bit for bit in ``before_step``, so evaluation, checkpoints and the optimizer see the true weights. Cost:
one copy of the parameters and of this rank's gradients, and one optimizer step on a copy of its state
per step (``own``; ``last``: two passes over the parameters).

Communication and memory: the same bytes per step as ``allreduce`` with the codec; one extra flat
fp32 copy of the gradients in flight and one pending averaged gradient (checkpointed). The
averaging runs in its own process group, so it may stay in flight across the loop's collectives.
"""

from __future__ import annotations

import collections
import logging
import math

import torch
from torch import Tensor

from thinwire.compress.sync.base import _PREVIEW, Buckets, StepParts, SyncMode, cpu_list, drop_unused, on_device
from thinwire.perf.sync import delayed_step_s


log = logging.getLogger("thinwire.compress")

_STEP_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")  # torch.optim.Optimizer's own


@torch.no_grad()
def predict_weights(params: list[Tensor], held: list[Tensor] | None) -> list[Tensor]:
    """``predict=last`` (module docstring): ``params`` (``w_t``) move by their last update
    (``w_t - held``); returns ``held`` now holding ``w_t``, to be copied back after backward. Without
    ``held`` (no last update yet): copies of ``params``, which stay where they are."""
    if held is None:
        return [p.detach().clone() for p in params]
    for p, h in zip(params, held):
        update = p - h
        h.copy_(p)
        p.add_(update)
    return held


@torch.no_grad()
def preview_step(optimizer: torch.optim.Optimizer, params: list[Tensor], grads: list[Tensor],
                 clip: float | None = None) -> None:
    """``predict=own`` (module docstring): move ``params`` to where ``optimizer.step()`` would put them with
    ``grads`` as their gradients (clipped to total norm ``clip``; ``grads`` are clipped in place), at the
    optimizer's current learning rate. The optimizer's state (moments, step counts) and every
    parameter's ``.grad`` are as they were afterwards; its other parameters do not move. Hooks registered on
    this optimizer's step (an EMA of the weights, say) do not run: this step is not one of the run's."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer  # accelerate's AcceleratedOptimizer: the one it wraps, stepped as it is
    every = [p for group in optimizer.param_groups for p in group["params"]]
    saved_grads = [p.grad for p in every]
    saved_state = {p: optimizer.state[p] for p in params if p in optimizer.state}
    hooks = {name: getattr(optimizer, name) for name in _STEP_HOOKS if isinstance(getattr(optimizer, name, None), dict)}
    try:
        _PREVIEW.active = True
        for name in hooks:
            setattr(optimizer, name, collections.OrderedDict())
        for p in every:
            p.grad = None
        for p, g in zip(params, grads):
            if p in saved_state:  # the step works on a copy of the state
                optimizer.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved_state[p].items()}
            p.grad = g
        if clip is not None and math.isfinite(clip):
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
    finally:
        _PREVIEW.active = False
        for name, value in hooks.items():
            setattr(optimizer, name, value)
        for p, g in zip(every, saved_grads):
            p.grad = g
        for p in params:
            if p in saved_state:
                optimizer.state[p] = saved_state[p]
            else:  # the preview's first step made the state: it was not there
                optimizer.state.pop(p, None)


class Delayed(SyncMode):
    name = "delayed"
    state_keys = ("started", "pending", "held", "own", "used")
    buffers_diverge = True  # forward runs under no_sync: DDP sends no buffers, each rank keeps its own statistics
    key_offset = 0  # error-feedback keys of its buckets start here (``auto`` shares a CommState with the DDP hook)

    def __init__(self, model, comm, spec=None, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.buckets = Buckets.trainable(model, int(bucket_mb * 2**20))
        self.pending: list = []           # futures (in flight) or tensors (done) of the last step's averages
        self.pending_used = None          # find_unused_parameters: which parameters some rank used in that step
        self.started = False              # whether any step's average exists (after a resume: loaded)
        self.predict = getattr(spec, "predict", "own")  # own, last or off (SyncSpec's PREDICTORS)
        self.clip: float | None = None    # own: the gradient norm the trainer clips to (set by the trainer)
        self.own: list[Tensor] | None = None   # own: this rank's flat gradients of the last step
        self.held: list[Tensor] | None = None  # prediction: the true weights (while shifted) or the last step's
        self.shifted = False                   # prediction: the parameters are at the predicted point
        self.predicted = False                 # this step's first training forward has been seen
        self.active = True                     # ``auto`` (ChooseSync) turns it off while it runs allreduce
        self._told = False                     # own without an optimizer: the fallback was logged
        self._hook = model.register_forward_pre_hook(self._on_forward) if self.predict != "off" else None

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        return delayed_step_s(compute_s=parts.compute_s, comm_s=parts.comm_s, codec_s=parts.codec_s,
                              codec_steals_compute=parts.codec_steals_compute)

    def no_sync(self):
        return self.model.no_sync()

    def _on_forward(self, module, args) -> None:
        """The first training forward of a step: the parameters move to where this step's gradient will
        be applied (module docstring); ``held`` keeps the true weights."""
        if self.predicted or not self.active or not torch.is_grad_enabled() or \
                not any(m.training for m in module.modules()):  # Lightning: the DDP wrapper stays in eval mode
            return                                              # after validation, the module trains again
        self.predicted = True
        params = self.buckets.params
        if self.predict == "own" and self.own is None:  # the first step: no gradient of this rank's yet
            return
        if self._by_own:
            if self.held is None:
                self.held = [p.detach().clone() for p in params]
            else:
                with torch.no_grad():
                    for p, h in zip(params, self.held):
                        h.copy_(p)
            grads = self.buckets.unflatten([f.clone() for f in self.own])  # clipped in place; own stays as sent
            preview_step(self.optimizer, params, grads, self.clip)
            self.shifted = True
            return
        if self.predict == "own" and not self._told:
            self._told = True
            log.warning("sync delayed: the optimizer is not known at this step's forward (mode.step(optimizer) tells it "
                        "only after the first step, too late for the first step of a resumed run), so this step's weights "
                        "are predicted by repeating the last update (predict=last), which costs more samples and makes a "
                        "resume inexact; pass optimizer= to thinwire.sync, or set mode.optimizer = optimizer before "
                        "training, for the prediction from this rank's own gradient (predict=own)")
        first = self.held is None  # last: the first step (or one after switching to delayed): no last update yet
        self.held = predict_weights(params, self.held)
        self.shifted = not first

    @property
    def _by_own(self) -> bool:
        """Whether this step predicts by the optimizer's step with the rank's own gradient (else: the last update)."""
        return self.predict == "own" and self.optimizer is not None

    def _restore(self) -> None:
        """The true weights back (bit for bit) before the optimizer steps from them."""
        self.predicted = False
        if self.shifted:
            with torch.no_grad():
                for p, h in zip(self.buckets.params, self.held):
                    p.copy_(h)
            self.shifted = False
        elif self.held is not None and not self._by_own:  # last, a step without a training forward: the next update is from here
            with torch.no_grad():
                for p, h in zip(self.buckets.params, self.held):
                    h.copy_(p)

    def before_step(self) -> None:
        self._restore()
        params = self.buckets.params
        flats = self.buckets.flatten([p.grad for p in params])
        if self.predict == "own":  # before the codec's error feedback adds to them
            # a non-finite gradient (a step the trainer skips) must not predict the next step's weights: they
            # would be non-finite, then that step's gradient, and so on, every later step skipped
            finite = all(bool(torch.isfinite(f).all()) for f in flats)
            self.own = [f.clone() for f in flats] if finite else None
        futures = self.buckets.average(self.comm, flats, first=self.key_offset)
        used = self.start_used(params)
        previous = self._collect() if self.started else None
        previous_used = self._collect_used()
        self.pending, self.pending_used, self.started = futures, used, True
        if previous is None:  # pipeline fill: nothing averaged yet, nothing applied
            for p in params:
                p.grad = None
            return
        for p, g in zip(params, self.buckets.unflatten(previous)):
            p.grad = g.clone()
        drop_unused(params, previous_used)

    def _collect(self) -> list[Tensor]:
        return [f if isinstance(f, Tensor) else f.wait() for f in self.pending]

    def _collect_used(self) -> Tensor | None:
        used = self.pending_used
        return used.wait() if isinstance(used, torch.futures.Future) else used

    def flush(self) -> None:
        self.pending = self._collect()
        self.pending_used = self._collect_used()

    def state_dict(self) -> dict:
        self.flush()
        return {**self.saved_by(), "started": self.started,
                "pending": cpu_list(self.pending) if self.started else None,
                "held": cpu_list(self.held) if self.predict == "last" and not self.shifted else None,
                "own": cpu_list(self.own) if self.predict == "own" and self.own is not None else None,
                "used": self.pending_used.cpu().clone() if self.pending_used is not None else None}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        self.started = bool(sd.get("started", False))
        pending = sd.get("pending")
        like = self.buckets.flatten([None] * len(self.buckets.params))  # the buckets' sizes, on the model's device
        self.pending = on_device(pending, like) if pending is not None else []
        used = sd.get("used")  # a checkpoint without it (or of a model without find_unused_parameters): all used
        self.pending_used = used.to(like[0].device).clone() if used is not None else None
        held = sd.get("held") if self.predict == "last" else None  # a checkpoint without it: the next step predicts nothing
        self.held, self.shifted, self.predicted = (on_device(held, self.buckets.params) if held is not None else None), False, False
        own = sd.get("own") if self.predict == "own" else None
        self.own = on_device(own, like) if own is not None else None
        self._own_buffers_on_resume()

    def close(self) -> None:
        self._restore()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super().close()

