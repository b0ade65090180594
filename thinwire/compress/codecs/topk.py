"""``topk``: send the ``k = max(1, ceil(ratio * numel))`` entries of largest magnitude.

Aji & Heafield, "Sparse Communication for Distributed Gradient Descent" (EMNLP 2017); Stich et al.,
"Sparsified SGD with Memory" (NeurIPS 2018) for why it needs error feedback (it is biased).

Selection:

* exact: ``torch.topk(|x|, k)``, O(numel log k) and slow on CPU for large ``numel``;
* approximate (``approx=true``, or by default when ``numel >= approx_threshold``): estimate the
  threshold from ``sample_size`` entries drawn at random (generator seeded by ``(meta.seed,
  meta.rank)``) as the sample's ``(1.5 * ratio)``-quantile plus a margin of 4 standard deviations,
  keep every entry ``>= threshold`` (one pass), then the exact top-k of those candidates. With
  enough candidates the result is the exact top-k; with fewer (rare: a sampling accident) the
  missing entries are padded with value 0 at index 0, so the payload size never depends on the data.

Payload: ``[values: fp32 (k,), indices: int32 (k,)]``, 8 bytes per kept entry whatever the input
dtype (``numel`` must be < 2**31). Decoding adds values at their indices (``index_add_``), so the
zero padding at index 0 is harmless. Not summable: indices differ across ranks, the collective
layer all-gathers payloads.

Example::

    >>> codec = TopKCodec(TopKConfig(ratio=0.5))
    >>> codec.roundtrip(torch.tensor([0.1, -3.0, 2.0, 0.5]), Meta(numel=4)).tolist()
    [0.0, -3.0, 2.0, 0.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import (
    check_input, check_int, check_ratio, flat_fp32, generator, mix_seed, param, sparse_k, to_dtype,
)
from thinwire.config import check

# Aim the sampled threshold at 1.5 k candidates (+ 4 sigma of sampling noise) so that a sampling
# accident rarely leaves fewer than k; the extra candidates cost one small top-k.
_OVERSAMPLE = 1.5
_SIGMAS = 4.0


@dataclass(kw_only=True, frozen=True)
class TopKConfig:
    ratio: float = param(0.01, "0 < ratio <= 1", "fraction of entries kept")
    approx: bool | None = param(None, "true|false|none", "sampled threshold; none = auto by size")
    approx_threshold: int = param(1_000_000, ">= 1", "numel from which approx=none samples")
    sample_size: int = param(10_000, ">= 1", "entries sampled to estimate the threshold")

    def __post_init__(self) -> None:
        check_ratio("topk.ratio", self.ratio)
        check(self.approx is None or isinstance(self.approx, bool), "topk.approx", self.approx,
              "true, false or none (none: approximate when numel >= approx_threshold)")
        check_int("topk.approx_threshold", self.approx_threshold, 1, 2**62)
        check_int("topk.sample_size", self.sample_size, 1, 2**62)


class TopKCodec(Codec):
    """Magnitude top-k sparsification (see the module docstring)."""

    name = "topk"
    candidate = "topk:ratio=0.01"
    config_cls = TopKConfig
    summable = False
    sparse = True

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        check_input(x, meta)
        if meta.numel >= 2**31:
            raise ValueError(f"topk sends int32 indices: a bucket must hold < 2**31 values, got {meta.numel}. "
                             "Use smaller buckets.")
        x32 = flat_fp32(x)
        k = sparse_k(meta.numel, self.config.ratio)
        if self.uses_approx(meta.numel):
            idx, valid = self._approx_indices(x32.abs(), k, meta)
            values = torch.where(valid, x32[idx], 0.0)
        else:
            idx = torch.topk(x32.abs(), k, sorted=False).indices
            values = x32[idx]
        return [values, idx.to(torch.int32)]

    def uses_approx(self, numel: int) -> bool:
        """Whether a tensor of ``numel`` elements takes the sampled-threshold path."""
        if numel == 0:
            return False
        if self.config.approx is None:
            return numel >= self.config.approx_threshold
        return self.config.approx

    def _approx_indices(self, a: Tensor, k: int, meta: Meta) -> tuple[Tensor, Tensor]:
        """``k`` indices (the exact top-k when enough entries pass the sampled threshold) and a
        mask of the valid ones (the others are padding at index 0)."""
        candidates = (a >= self._threshold(a, meta)).nonzero().squeeze(1)
        if candidates.numel() >= k:
            best = torch.topk(a[candidates], k, sorted=False).indices
            return candidates[best], torch.ones(k, dtype=torch.bool, device=a.device)
        pad = k - candidates.numel()
        idx = torch.cat([candidates, candidates.new_zeros(pad)])
        valid = torch.arange(k, device=a.device) < candidates.numel()
        return idx, valid

    def _threshold(self, a: Tensor, meta: Meta) -> Tensor:
        """The sample's magnitude that about ``1.5 k`` entries of ``a`` exceed."""
        m = min(self.config.sample_size, a.numel())
        g = generator(a.device, mix_seed(meta.seed, meta.rank))
        sample = a[torch.randint(a.numel(), (m,), generator=g, device=a.device)]
        expected = _OVERSAMPLE * self.config.ratio * m
        above = min(m, math.ceil(expected + _SIGMAS * math.sqrt(expected)) + 1)
        return torch.topk(sample, above, sorted=False).values.min()

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        values, idx = payload
        out = torch.zeros(meta.numel, dtype=torch.float32, device=values.device)
        return to_dtype(out.index_add_(0, idx, values), meta.dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 8 * sparse_k(numel, self.config.ratio)
