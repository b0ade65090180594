"""``qsgd``: unbiased stochastic quantisation to ``levels`` levels per block norm.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and Encoding"
(NeurIPS 2017). For each block ``v`` of ``block`` values with ``s = levels``:

1. ``norm = ||v||_2``, computed as ``max|v| * ||v / max|v|||`` so it neither overflows (1e30) nor
   underflows (1e-30) in fp32;
2. ``r_i = s * |v_i| / norm`` in ``[0, s]``; ``l_i = floor(r_i + u_i)`` with ``u_i ~ U[0, 1)``, i.e.
   ``floor(r_i)`` plus one with probability ``frac(r_i)``, so ``E[l_i] = r_i``;
3. send ``sign(v_i) * l_i`` as int8 and ``norm``; decode ``x_hat_i = norm * sign_i * l_i / s``.

Properties: unbiased, ``E[x_hat] = x``; ``|x_i - x_hat_i| < norm / s`` for every draw; variance
``E||x_hat - x||^2 <= min(block / s**2, sqrt(block) / s) * ||x||^2`` (Lemma 3.1).

Payload: ``[norm: fp32 (n_blocks,), levels: int8 (n_blocks * block,)]``, ratio
``4 * block / (block + 4)`` = 3.996x at ``block=4096``. The paper's Elias coding of the levels is
not done: it would make the size data-dependent, and all-gathered payloads must have equal sizes.
Not summable. Noise comes from a generator seeded by ``(meta.seed, meta.rank)``.

Example::

    >>> codec = QsgdCodec(QsgdConfig(levels=127))
    >>> x = torch.randn(10_000)
    >>> x_hat = codec.roundtrip(x, Meta(numel=10_000, seed=1))
    >>> bool(((x_hat - x).abs() < x.norm() / 127).all())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import (
    FP32_MAX, as_blocks, block_absmax, check_input, check_int, flat_fp32, generator, mix_seed,
    n_blocks, param, to_dtype, round_toward_zero,
)


@dataclass(kw_only=True, frozen=True)
class QsgdConfig:
    levels: int = param(127, "1..127", "quantisation levels s per sign (int8 holds +-127)")
    block: int = param(4096, "1..16777216", "values sharing one fp32 norm")

    def __post_init__(self) -> None:
        check_int("qsgd.levels", self.levels, 1, 127, "E.g. qsgd:levels=127.")
        check_int("qsgd.block", self.block, 1, 1 << 24, "E.g. qsgd:block=4096.")


class QsgdCodec(Codec):
    """QSGD stochastic quantisation (see the module docstring)."""

    name = "qsgd"
    config_cls = QsgdConfig
    summable = False

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        check_input(x, meta)
        s = self.config.levels
        blocks = as_blocks(flat_fp32(x), self.config.block)
        amax = block_absmax(blocks)
        y = blocks / torch.where(amax > 0, amax, 1.0).unsqueeze(1)  # |y| <= 1
        unit_norm = torch.linalg.vector_norm(y, dim=1)  # in [1, sqrt(block)], or 0 for a zero block
        r = y.abs_().mul_((s / torch.where(unit_norm > 0, unit_norm, 1.0)).unsqueeze(1))
        noise = torch.rand(r.shape, generator=generator(r.device, mix_seed(meta.seed, meta.rank)),
                           device=r.device)
        levels = r.add_(noise).floor_().clamp_(max=s).copysign_(blocks)
        norm = (amax * unit_norm).clamp_(max=FP32_MAX)
        return [norm, levels.to(torch.int8).view(-1)]

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        norm, levels = payload
        unit = round_toward_zero(norm / self.config.levels)  # |levels| <= s: no overflow
        x = levels.view(-1, self.config.block).to(torch.float32).mul_(unit.unsqueeze(1))
        return to_dtype(x.view(-1)[: meta.numel], meta.dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        nb = n_blocks(numel, self.config.block)
        return 4 * nb + nb * self.config.block
