"""Error feedback: what compression dropped is added back to the next step's gradient.

For each bucket a residual ``r`` (created lazily, the bucket's size, fp32) keeps what the codec lost:

    corrected = grad + r
    sent      = decode(encode(corrected))
    r         = corrected - sent          # so: sent + r_new == grad + r_old, exactly

This is the memory of Seide et al. (1-bit SGD, 2014) and Karimireddy et al. (EF-SignSGD, 2019); it
makes biased codecs (top-k, sign) converge like SGD. Memory cost: one fp32 copy of the gradients,
logged once when the residuals are first created. The residuals are per rank and are saved in
thinwire checkpoints, so a resumed run continues with the same memory.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger("thinwire.compress")


class ErrorFeedback:
    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}
        self._logged = False

    def corrected(self, key: str, grad: Tensor) -> Tensor:
        """``grad + residual`` in fp32 (a new tensor; ``grad`` is left untouched)."""
        r = self.residuals.get(key)
        if r is None or r.numel() != grad.numel() or r.device != grad.device:
            return grad.to(torch.float32, copy=True)
        return r + grad

    def update(self, key: str, corrected: Tensor, sent: Tensor) -> None:
        fresh = key not in self.residuals
        self.residuals[key] = corrected - sent.to(corrected.dtype)
        if fresh and not self._logged and self.nbytes() > 0:
            self._logged = True
            log.info("error feedback: residual memory %.2f MB per rank (grows with each new bucket)", self.nbytes() / 2**20)

    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

    def state_dict(self) -> dict:
        return {k: v.detach().cpu().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.residuals = {str(k): v.clone() for k, v in sd.items()}
