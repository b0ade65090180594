"""``diloco:period=H,outer_lr=0.7,outer_momentum=0.9``: DiLoCo's outer Nesterov step every H steps.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models" (2023,
https://arxiv.org/abs/2311.08105), Algorithm 1: each rank runs the training optimizer (the inner
optimizer, AdamW in the paper and in ``thinwire train``) for H steps from the anchor ``a``; then the
pseudo-gradient ``d_i = a - x_i`` is averaged (here through the codec with error feedback) and an outer
SGD step with Nesterov momentum moves the anchor, exactly as ``torch.optim.SGD(nesterov=True)``:

    m <- mu * m + d          (m <- d at the first average)
    a <- a - lr * (d + mu * m)
    x_i <- a

With H=1, lr=1 and mu=0 this is data-parallel SGD with the inner optimizer's update averaged.
Communication as :mod:`.local` (one parameter-sized average per H steps); memory: the anchor and the
outer momentum, two fp32 copies of the parameters (both checkpointed).
"""

from __future__ import annotations

from torch import Tensor

from thinwire.compress.sync.base import cpu_list, on_device
from thinwire.compress.sync.local import LocalSGD


class DiLoCo(LocalSGD):
    name = "diloco"
    state_keys = ("steps", "anchor", "momentum")

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec, bucket_mb=bucket_mb)
        self.lr, self.mu = spec.outer_lr, spec.outer_momentum
        self.momentum: list[Tensor] | None = None

    def outer_step(self, pseudo_grads: list[Tensor]) -> None:
        self.momentum = nesterov_step(self.anchor, pseudo_grads, self.momentum, lr=self.lr, mu=self.mu)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "momentum": cpu_list(self.momentum)}

    def load_state_dict(self, sd: dict) -> None:
        super().load_state_dict(sd)
        self.momentum = on_device(sd.get("momentum"), self._flat_params())


def nesterov_step(anchor: list[Tensor], pseudo_grads: list[Tensor], momentum: list[Tensor] | None, *, lr: float,
                  mu: float) -> list[Tensor]:
    """The outer step (module docstring) on ``anchor`` in place; returns the momentum (new at the first call;
    None without momentum: no copy of the parameters kept)."""
    if mu == 0:
        for a, g in zip(anchor, pseudo_grads):
            a.sub_(g, alpha=lr)
        return None
    if momentum is None:
        momentum = [g.clone() for g in pseudo_grads]
    else:
        for m, g in zip(momentum, pseudo_grads):
            m.mul_(mu).add_(g)
    for a, g, m in zip(anchor, pseudo_grads, momentum):
        a.sub_(g.add(m, alpha=mu), alpha=lr)
    return momentum
