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

Communication and memory: the same bytes per step as ``allreduce`` with the codec; one extra flat
fp32 copy of the gradients in flight and one pending averaged gradient (checkpointed). The
averaging runs in its own process group, so it may stay in flight across the loop's collectives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from thinwire.compress.sync.base import Buckets, StepParts, SyncMode, cpu_list, on_device, params_of
from thinwire.perf.sync import delayed_step_s


class Delayed(SyncMode):
    name = "delayed"
    key_offset = 0  # error-feedback keys of its buckets start here (``auto`` shares a CommState with the DDP hook)

    def __init__(self, model, comm, spec=None, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.buckets = Buckets(params_of(model), int(bucket_mb * 2**20))
        self.pending: list = []           # futures (in flight) or tensors (done) of the last step's averages
        self.started = False              # whether any step's average exists (after a resume: loaded)

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        return delayed_step_s(compute_s=parts.compute_s, comm_s=parts.comm_s, codec_s=parts.codec_s,
                              codec_steals_compute=parts.codec_steals_compute)

    def no_sync(self):
        return self.model.no_sync()

    def before_step(self) -> None:
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
        return {"started": self.started, "pending": cpu_list(self.pending) if self.started else None}

    def load_state_dict(self, sd: dict) -> None:
        self.started = bool(sd.get("started", False))
        pending = sd.get("pending")
        like = [torch.empty(0, device=self.buckets.params[0].device)] * len(pending or [])
        self.pending = on_device(pending, like) if pending is not None else []
