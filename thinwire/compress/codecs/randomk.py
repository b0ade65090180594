"""``randomk``: send ``k = max(1, ceil(ratio * numel))`` entries at positions every rank agrees on.

Stich et al., "Sparsified SGD with Memory" (NeurIPS 2018); Wangni et al., "Gradient Sparsification
for Communication-Efficient Distributed Optimization" (NeurIPS 2018).

The positions come from a generator seeded by ``meta.seed`` alone, identical on every rank, so
they never travel and the values of all ranks line up: the payload is *summable* and one
all-reduce of ``k`` fp32 values does the job (4 bytes per kept entry, ratio ``1 / ratio``).

Sampling is *stratified*: ``[0, numel)`` is cut into ``k`` strata
``[floor(j * numel / k), floor((j + 1) * numel / k))`` and one position is drawn uniformly in
each. That gives ``k`` distinct sorted positions in O(k) time and memory (``randperm`` would cost
O(numel)), spreads them evenly over the buffer, and is lossless at ``ratio=1``.

Scale: by default values are sent as they are (``rescale=false``): biased (``E[x_hat] = (k /
numel) x``), the form used with error feedback. ``rescale=true`` multiplies each value by its
stratum's size ``~ numel / k`` (one over its probability of being picked), which makes
``E[x_hat] = x`` exactly, at the price of a variance ``~ numel / k`` times larger.

Example::

    >>> codec = RandomKCodec(RandomKConfig(ratio=0.25))
    >>> x = torch.arange(8.0)
    >>> rank0 = codec.compress(x, Meta(numel=8, seed=7, rank=0))
    >>> rank1 = codec.compress(2 * x, Meta(numel=8, seed=7, rank=1))
    >>> summed = codec.decompress([rank0[0] + rank1[0]], Meta(numel=8, seed=7))
    >>> bool((summed == 3 * codec.roundtrip(x, Meta(numel=8, seed=7))).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import (
    FP32_MAX, check_bool, check_input, check_ratio, flat_fp32, generator, param, sparse_k, to_dtype,
)


@dataclass(kw_only=True, frozen=True)
class RandomKConfig:
    ratio: float = param(0.01, "0 < ratio <= 1", "fraction of entries kept")
    rescale: bool = param(False, "true|false", "scale values by numel/k (unbiased, no error feedback)")

    def __post_init__(self) -> None:
        check_ratio("randomk.ratio", self.ratio)
        check_bool("randomk.rescale", self.rescale)


class RandomKCodec(Codec):
    """Random-k sparsification with positions shared by all ranks (see the module docstring)."""

    name = "randomk"
    config_cls = RandomKConfig
    summable = True
    shared_randomness = True
    sparse = True

    @property
    def needs_feedback(self) -> bool:
        """``rescale=true`` is unbiased: a residual would add back what the next step's scaled values already
        carry in expectation, and grows without bound (numel/k times the gradient each step)."""
        return not self.config.rescale

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        check_input(x, meta)
        idx, _ = self.positions(meta.numel, meta.seed, x.device)
        return [flat_fp32(x)[idx]]

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        (values,) = payload
        idx, stratum = self.positions(meta.numel, meta.seed, values.device)
        if self.config.rescale:
            values = (values * stratum).clamp_(-FP32_MAX, FP32_MAX)  # finite, even for huge inputs
        out = torch.zeros(meta.numel, dtype=torch.float32, device=values.device)
        return to_dtype(out.index_copy_(0, idx, values.to(torch.float32)), meta.dtype)

    def positions(self, numel: int, seed: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The ``k`` sorted distinct positions for ``seed`` (the same on every rank) and the size
        of the stratum each was drawn from."""
        k = sparse_k(numel, self.config.ratio)
        j = torch.arange(k + 1, dtype=torch.int64, device=device)
        bounds = torch.div(j * numel, max(k, 1), rounding_mode="floor")
        start, stratum = bounds[:-1], bounds[1:] - bounds[:-1]
        u = torch.rand(k, dtype=torch.float64, generator=generator(device, seed), device=device)
        offset = torch.minimum((u * stratum).to(torch.int64), stratum - 1)
        return start + offset, stratum.to(torch.float32)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 4 * sparse_k(numel, self.config.ratio)
