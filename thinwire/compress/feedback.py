"""Error feedback: what compression dropped is added back to the next step's gradient.

For each bucket a residual ``r`` (created lazily, the bucket's size, fp32) keeps what the codec lost:

    corrected = grad + r
    sent      = decode(encode(corrected))
    r         = corrected - sent          # so: sent + r_new == grad + r_old, exactly

This is the memory of Seide et al. (1-bit SGD, 2014) and Karimireddy et al. (EF-SignSGD, 2019); it
makes biased codecs (top-k, sign) converge like SGD. Memory cost: one fp32 copy of the gradients,
logged once when the residuals are first created.

Residuals are flat per bucket on the hot path, but a bucket's *layout* (which parameters, in which
order) is not fixed: DDP rebuilds its buckets after the first iteration, and a resumed process
starts again from the initial layout. So each residual remembers its layout (parameter indices), is
saved per parameter (``state_dict``), and is re-cut whenever a bucket arrives with a new layout.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger("thinwire.compress")

Layout = tuple[tuple[int, int], ...]  # (parameter index, numel) in bucket order


class ErrorFeedback:
    def __init__(self) -> None:
        self.residuals: dict[str, tuple[Layout, Tensor]] = {}
        self.pending: dict[int, Tensor] = {}  # per-parameter residuals awaiting their new bucket
        self._logged = False

    def corrected(self, key: str, grad: Tensor, layout: Layout | None = None) -> Tensor:
        """``grad + residual`` in fp32 (a new tensor; ``grad`` is left untouched)."""
        held = self.residuals.get(key)
        if held is not None and (layout is None or held[0] == layout) and held[1].numel() == grad.numel():
            return held[1] + grad
        if layout is None:
            return grad.to(torch.float32, copy=True)
        self._unbucket()
        pieces = [self.pending.pop(i, None) for i, _ in layout]
        if any(p is not None and p.numel() != n for p, (_, n) in zip(pieces, layout)):
            # a piece of another size is another parameter's (a checkpoint that indexed them otherwise): not this one's
            log.warning("error feedback: a held residual does not fit bucket %s's parameters (indexed otherwise when it "
                        "was kept); theirs start empty", key)
            pieces = [p if p is not None and p.numel() == n else None for p, (_, n) in zip(pieces, layout)]
        if all(p is None for p in pieces):
            return grad.to(torch.float32, copy=True)
        flat = torch.cat([p.to(grad.device) if p is not None else torch.zeros(n, device=grad.device)
                          for p, (_, n) in zip(pieces, layout)])
        return flat + grad

    def holds(self, key: str, layout: Layout | None = None) -> bool:
        """Whether a residual waits for this bucket (its own, or its parameters' after a re-bucketing)."""
        return key in self.residuals or (layout is not None and any(i in self.pending for i, _ in layout))

    def drop(self, key: str) -> None:
        """Forget the bucket's residual (it was sent: the bucket's codec keeps none)."""
        self.residuals.pop(key, None)

    def update(self, key: str, corrected: Tensor, sent: Tensor, layout: Layout | None = None) -> None:
        """Keep ``corrected - sent`` as the residual, computed in place: ``corrected`` (from
        :meth:`corrected`, or any fp32 tensor the caller is done with) becomes the residual."""
        fresh = key not in self.residuals
        self.residuals[key] = (layout or (), corrected.sub_(sent))
        if fresh and not self._logged:
            self._logged = True
            log.info("error feedback: residuals of %.2f MB per rank (one fp32 copy of each compressed bucket)",
                     sum(r.numel() * 4 for _, r in self.residuals.values()) / 2**20 or corrected.numel() * 4 / 2**20)

    def _unbucket(self) -> None:
        """Move every bucketed residual into per-parameter pieces (a layout changed)."""
        for key in list(self.residuals):
            layout, flat = self.residuals[key]
            if layout:
                self.pending.update(_split(layout, flat))
                del self.residuals[key]

    def nbytes(self) -> int:
        held = sum(r.numel() * r.element_size() for _, r in self.residuals.values())
        return held + sum(r.numel() * r.element_size() for r in self.pending.values())

    def state_dict(self) -> dict:
        params = {str(i): t.detach().cpu().clone() for i, t in self.pending.items()}
        other = {}
        for key, (layout, flat) in self.residuals.items():
            if layout:
                params.update({str(i): t.detach().cpu().clone() for i, t in _split(layout, flat).items()})
            else:
                other[key] = flat.detach().cpu().clone()
        return {"params": params, "buckets": other}

    def load_state_dict(self, sd: dict) -> None:
        self.pending = {int(i): t.clone() for i, t in sd.get("params", {}).items()}
        self.residuals = {k: ((), t.clone()) for k, t in sd.get("buckets", {}).items()}


def _split(layout: Layout, flat: Tensor) -> dict[int, Tensor]:
    out, offset = {}, 0
    for i, n in layout:
        out[i] = flat[offset : offset + n]
        offset += n
    return out


def shadow_step(codec, g: Tensor, residual: Tensor | None = None) -> tuple[Tensor, float, float]:
    """One step of error feedback in shadow, nothing sent: ``(r, ||r|| / ||g + r_prev||, ||g + r_prev||)``
    with ``r = (g + r_prev) - C(g + r_prev)`` for flat ``g`` (``residual``: ``r_prev`` or None).

    ``||r|| / ||g + r_prev||`` is the relative compression error with error feedback, the share of
    what was due that the step left behind: the quantity ``thinwire profile`` measures per codec
    and the planner and ``auto`` cap (:data:`thinwire.plan.choose.MAX_EF_ERROR`). Costs one encode
    and decode of ``g`` and two temporaries of its size."""
    from thinwire.compress.codecs import Meta

    corrected = g + residual if residual is not None and residual.numel() == g.numel() else g.clone()
    r = corrected - codec.roundtrip(corrected, Meta(numel=corrected.numel()))
    norm = float(corrected.norm())
    return r, (float(r.norm()) / norm if norm > 0 else 0.0), norm
