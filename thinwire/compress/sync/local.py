"""``local:period=H,warmup=W``: post-local SGD, parameters averaged every H steps through a codec.

The semantics of PyTorch's ``PostLocalSGDState(start_localSGD_iter=W)`` with
``PeriodicModelAverager(period=H, warmup_steps=W)`` (Lin et al., "Don't Use Large Mini-Batches, Use
Local SGD", ICLR 2020, https://arxiv.org/abs/1808.07217):

1. for the first W steps gradients are averaged before each optimizer step, so all ranks stay identical
   (PyTorch's warm-up all-reduce), through the codec with error feedback as ``allreduce`` averages them
   (PyTorch's is fp32: the same here with ``--compression none``; a thin link pays the codec's bytes, not fp32's);
2. then every rank steps on its own gradients, with its own optimizer state;
3. after every H-th local step the parameters are averaged. Here the *change* since the last average
   travels (the anchor ``a`` minus the parameters: ``d_i = a - x_i``), through the codec with error
   feedback, and every rank sets ``a <- a - mean(d_i)`` and ``x_i <- a``. With an exact codec this is
   ``mean(x_i)``, PyTorch's average; with a lossy one only the change is compressed, never the weights.

Communication: one average of all parameters per H steps (the bytes of one gradient all-reduce with
the codec). Memory: one fp32 copy of the parameters (the anchor) and the codec's residuals.
:class:`~thinwire.compress.sync.diloco.DiLoCo` replaces step 3's update with an outer optimizer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from thinwire.compress.sync.base import Buckets, StepParts, SyncMode, average_gradients, cpu_list, on_device
from thinwire.perf.sync import periodic_step_s

GRADIENT_KEYS = 1 << 21  # the warm-up's gradient buckets' residual keys, apart from the parameter averages' (0, 1, ...)


class LocalSGD(SyncMode):
    name = "local"
    state_keys = ("steps", "anchor")
    diverges = True

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.period, self.warmup = spec.period, spec.warmup
        self.buckets = Buckets.trainable(model, int(bucket_mb * 2**20))
        self.steps = 0                        # optimizer steps taken
        self.anchor: list[Tensor] | None = None  # flat parameters at the last average

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        """After the warm-up: compute, and one blocking average per ``period`` steps."""
        return periodic_step_s(compute_s=parts.compute_s, average_s=parts.comm_s + parts.codec_s, period=spec.period)

    @classmethod
    def bytes_per_step(cls, spec, bytes_per_average: int, hosts: int = 2) -> float:
        return bytes_per_average / spec.period

    def no_sync(self):
        return self.model.no_sync()

    def before_step(self) -> None:
        if self.steps < self.warmup:
            self.warmup_average()
        elif self.anchor is None:
            self.anchor = self._flat_params()

    def warmup_average(self) -> None:
        """A synchronous warm-up step: the gradients averaged through the codec with error feedback, as
        ``allreduce`` averages them (PyTorch's post-local SGD all-reduces them in fp32: the same with
        ``--compression none``), under residual keys of their own (the parameter averages' are another quantity's)."""
        average_gradients(self, self.buckets, first=GRADIENT_KEYS)

    def after_step(self) -> None:
        self.steps += 1
        local = self.steps - self.warmup
        if local > 0 and local % self.period == 0:
            self.average()

    def steps_to_agreement(self) -> int | None:
        """0 through the warm-up (exact gradient averages keep the ranks equal) and at each average."""
        local = self.steps - self.warmup
        return 0 if local <= 0 else -local % self.period

    def average(self) -> None:
        """Average the change since the last average; every rank ends at the same new anchor."""
        assert self.anchor is not None, "a local step sets the anchor first"
        deltas = [a - x for a, x in zip(self.anchor, self._flat_params())]
        futures = self.buckets.average(self.comm, deltas)
        averaged = [f.wait() for f in futures]
        self.outer_step(averaged)
        with torch.no_grad():
            for p, a in zip(self.buckets.params, self.buckets.unflatten(self.anchor)):
                p.copy_(a)

    def outer_step(self, pseudo_grads: list[Tensor]) -> None:
        """Local SGD: the anchor moves by the whole averaged change (an outer SGD step of lr 1)."""
        for a, g in zip(self.anchor, pseudo_grads):
            a.sub_(g)

    def _flat_params(self) -> list[Tensor]:
        return self.buckets.flatten(list(self.buckets.params))

    def state_dict(self) -> dict:
        return {**self.saved_by(), "steps": self.steps, "anchor": cpu_list(self.anchor)}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        self.steps = int(sd.get("steps", 0))
        like = self._flat_params()
        self.anchor = on_device(sd.get("anchor"), like)
        self._own_buffers_on_resume()
