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

**Weight prediction** (``predict=1``, the default): a stale gradient is computed at ``w_t`` and applied
to ``w_{t+1}``. With an adaptive optimizer at the learning rates small models train at, that one step
costs much: charlm (2 layers, width 128) on 4 workers, 480 steps, ended 48% above DDP fp32's validation
loss (in one-process runs, with AdamW's momentum off or at a fifth of the learning rate, no better).
So each step's forward and backward run at the weights the gradient will be applied to, predicted as
``w_t + (w_t - w_{t-1})``: the last update repeated (the weight prediction of SpecTrain, Chen et al.
2018, https://arxiv.org/abs/1809.02839, and PipeMare, Yang et al. 2021, for pipeline staleness; an
adaptive optimizer's consecutive updates are close, since its momentum averages ~10 gradients). Measured
(``benchmarks/results/delayed_predict.md``): charlm +48% -> +34%, a GRU language model +1.3% -> +0.03%.
The parameters move to the predicted point on the first training forward of a step (a forward
pre-hook on the model: a forward in ``eval()`` mode or under ``no_grad`` leaves them) and are put back
bit for bit in ``before_step``, so evaluation, checkpoints and the optimizer see the true weights. Cost:
one copy of the parameters and two passes over them per step; ``predict=0`` gives Pipe-SGD's plain staleness.

Communication and memory: the same bytes per step as ``allreduce`` with the codec; one extra flat
fp32 copy of the gradients in flight and one pending averaged gradient (checkpointed). The
averaging runs in its own process group, so it may stay in flight across the loop's collectives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from thinwire.compress.sync.base import Buckets, StepParts, SyncMode, cpu_list, on_device
from thinwire.perf.sync import delayed_step_s


@torch.no_grad()
def predict_weights(params: list[Tensor], held: list[Tensor] | None) -> list[Tensor]:
    """The weight prediction (module docstring): ``params`` (``w_t``) move by their last update
    (``w_t - held``); returns ``held`` now holding ``w_t``, to be copied back after backward. Without
    ``held`` (no last update yet): copies of ``params``, which stay where they are."""
    if held is None:
        return [p.detach().clone() for p in params]
    for p, h in zip(params, held):
        update = p - h
        h.copy_(p)
        p.add_(update)
    return held


class Delayed(SyncMode):
    name = "delayed"
    key_offset = 0  # error-feedback keys of its buckets start here (``auto`` shares a CommState with the DDP hook)

    def __init__(self, model, comm, spec=None, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.buckets = Buckets.trainable(model, int(bucket_mb * 2**20))
        self.pending: list = []           # futures (in flight) or tensors (done) of the last step's averages
        self.started = False              # whether any step's average exists (after a resume: loaded)
        self.predict = bool(getattr(spec, "predict", 1))
        self.held: list[Tensor] | None = None  # prediction: the true weights (while shifted) or the last step's
        self.shifted = False                   # prediction: the parameters are at the predicted point
        self.active = True                     # ``auto`` (ChooseSync) turns it off while it runs allreduce
        self._hook = model.register_forward_pre_hook(self._on_forward) if self.predict else None

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        return delayed_step_s(compute_s=parts.compute_s, comm_s=parts.comm_s, codec_s=parts.codec_s,
                              codec_steals_compute=parts.codec_steals_compute)

    def no_sync(self):
        return self.model.no_sync()

    def _on_forward(self, module, args) -> None:
        """The first training forward of a step: the parameters move to where this step's gradient will
        be applied, ``w_t + (w_t - w_{t-1})`` (module docstring); ``held`` keeps ``w_t``."""
        if self.shifted or not self.active or not module.training or not torch.is_grad_enabled():
            return
        first = self.held is None  # the first step (or one after switching to delayed): no last update yet
        self.held = predict_weights(self.buckets.params, self.held)
        self.shifted = not first

    def _restore(self) -> None:
        """The true weights back (bit for bit) before the optimizer steps from them."""
        if self.shifted:
            with torch.no_grad():
                for p, h in zip(self.buckets.params, self.held):
                    p.copy_(h)
            self.shifted = False
        elif self.held is not None:  # a step without a training forward: the next update is from here
            with torch.no_grad():
                for p, h in zip(self.buckets.params, self.held):
                    h.copy_(p)

    def before_step(self) -> None:
        self._restore()
        params = self.buckets.params
        flats = self.buckets.flatten([p.grad for p in params])
        futures = self.buckets.average(self.comm, flats, first=self.key_offset)
        previous = self._collect() if self.started else None
        self.pending, self.started = futures, True
        if previous is None:  # pipeline fill: nothing averaged yet, nothing applied
            for p in params:
                p.grad = None
            return
        for p, g in zip(params, self.buckets.unflatten(previous)):
            p.grad = g.clone()

    def _collect(self) -> list[Tensor]:
        return [f if isinstance(f, Tensor) else f.wait() for f in self.pending]

    def flush(self) -> None:
        self.pending = self._collect()

    def state_dict(self) -> dict:
        self.flush()
        return {"started": self.started, "pending": cpu_list(self.pending) if self.started else None,
                "held": cpu_list(self.held) if self.predict and not self.shifted else None}

    def load_state_dict(self, sd: dict) -> None:
        self.started = bool(sd.get("started", False))
        pending = sd.get("pending")
        like = [torch.empty(0, device=self.buckets.params[0].device)] * len(pending or [])
        self.pending = on_device(pending, like) if pending is not None else []
        held = sd.get("held") if self.predict else None  # a checkpoint without it: the next step predicts nothing
        self.held, self.shifted = (on_device(held, self.buckets.params) if held is not None else None), False

    def close(self) -> None:
        self._restore()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        super().close()
