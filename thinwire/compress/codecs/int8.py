"""``int8``: block-wise absmax quantisation to 8-bit integers.

Algorithm, for each block of ``block`` consecutive values (the last one zero-padded):

1. ``scale = max|x| / 127`` (rounded one ulp toward zero so that ``127 * scale`` cannot overflow);
2. ``q = round(x / scale)`` clamped to ``[-127, 127]``, stored as int8 (round to nearest, or
   stochastic rounding ``floor(x / scale + u)``, ``u ~ U[0, 1)``, which is unbiased:
   ``E[q * scale] = x``);
3. decode ``x_hat = q * scale``.

With ``bits=4`` the same with ``[-7, 7]`` for ``[-127, 127]``, two values packed per byte (``q + 8``
in a nibble): half the bytes at 18x the rounding error, for what error feedback carries across steps,
e.g. the pseudo-gradients of local SGD and DiLoCo (Streaming DiLoCo sends its outer gradients in 4
bits: Douillard et al., 2025).

Error per value: ``|x - x_hat| <= scale / 2`` (nearest) or ``< scale`` (stochastic), i.e. at most
``max|x of its block| / 254`` resp. ``/ 127`` (``/ 14`` resp. ``/ 7`` at 4 bits).

Payload: ``[q: int8 (n_blocks * block,), scale: fp32 (n_blocks,)]``. Scales are fp32, not fp16,
because gradients below ~6e-8 would flush fp16 scales to zero. Cost: ``numel`` rounded up to a
multiple of ``block``, plus 4 bytes per block: ratio ``4 * block / (block + 4)`` = 3.94x at the
default ``block=256``. Not summable (each rank has its own scales), so the collective layer
all-gathers payloads and decodes each. Stochastic-rounding noise comes from a generator seeded by
``(meta.seed, meta.rank)``: reproducible, independent across ranks.

Block-wise absmax quantisation is the scheme of Dettmers et al., "8-bit Optimizers via Block-wise
Quantization" (ICLR 2022); stochastic rounding of gradients follows Gupta et al., "Deep Learning
with Limited Numerical Precision" (ICML 2015).

Example::

    >>> codec = Int8Codec(Int8Config(block=64))
    >>> x = torch.randn(1000)
    >>> err = (codec.roundtrip(x, Meta(numel=1000)) - x).abs().max()
    >>> bool(err <= x.abs().max() / 254 * 1.0001)
    True
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.config import check
from thinwire.compress.codecs.common import (
    as_blocks, block_absmax, check_bool, check_input, check_int, flat_fp32, generator, mix_seed,
    n_blocks, param, to_dtype, round_toward_zero,
)

_QMAX = {8: 127, 4: 7}


def _pack4(q: Tensor) -> Tensor:
    """uint8 values in [0, 15], an even count, two per byte: the even-indexed ones in the low nibbles. Read as
    little-endian int16 pairs ``v = lo + 256 * hi``, ``v | v >> 4`` holds ``lo + 16 * hi`` in its low byte (one
    pass; slicing the pairs apart took 1.8x as long)."""
    if sys.byteorder != "little":
        q = q.view(-1, 2)
        return q[:, 0] | (q[:, 1] << 4)
    v = q.view(torch.int16)
    return ((v | (v >> 4)) & 0xFF).to(torch.uint8)


def _unpack4(p: Tensor) -> Tensor:
    """The inverse of :func:`_pack4`: ``(p | p << 4) & 0x0F0F`` holds the low nibble in the low byte and the high
    nibble in the high byte of an int16, which read as bytes are the two values in order."""
    if sys.byteorder != "little":
        return torch.stack((p & 15, p >> 4), dim=1).view(-1)
    v = p.to(torch.int16)
    return ((v | (v << 4)) & 0x0F0F).view(torch.uint8)


@dataclass(kw_only=True, frozen=True)
class Int8Config:
    block: int = param(256, "8..65536", "values sharing one fp32 scale")
    stochastic: bool = param(False, "true|false", "stochastic (unbiased) instead of nearest rounding")
    bits: int = param(8, "8|4", "bits per value; 4 packs two values per byte")

    def __post_init__(self) -> None:
        check_int("int8.block", self.block, 8, 65536, "E.g. int8:block=256.")
        check_bool("int8.stochastic", self.stochastic)
        check(self.bits in _QMAX and not isinstance(self.bits, bool), "int8.bits", self.bits, "8 or 4",
              "E.g. int8:bits=4 sends half the bytes of int8.")
        check(self.bits == 8 or self.block % 2 == 0, "int8.block", self.block, "even with bits=4 (two values a byte)",
              "E.g. int8:bits=4,block=256.")


class Int8Codec(Codec):
    """Block-wise absmax int8 quantisation (see the module docstring)."""

    name = "int8"
    candidate = "int8"
    config_cls = Int8Config
    summable = False

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        check_input(x, meta)
        blocks = as_blocks(flat_fp32(x), self.config.block)
        qmax = _QMAX[self.config.bits]
        scale = round_toward_zero(block_absmax(blocks) / qmax)
        y = blocks / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
        if self.config.stochastic:
            noise = torch.rand(y.shape, generator=generator(y.device, mix_seed(meta.seed, meta.rank)),
                               device=y.device)
            y.add_(noise).floor_()
        else:
            y.round_()
        if self.config.bits == 4:
            return [_pack4(y.clamp_(-qmax, qmax).add_(8).to(torch.uint8)), scale]
        q = y.clamp_(-qmax, qmax).to(torch.int8)
        return [q.view(-1), scale]

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        q, scale = payload
        if self.config.bits == 4:
            q = _unpack4(q).view(torch.int8).sub_(8)
        x = q.view(-1, self.config.block).to(torch.float32).mul_(scale.unsqueeze(1))
        return to_dtype(x.view(-1)[: meta.numel], meta.dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        nb = n_blocks(numel, self.config.block)
        return nb * self.config.block * self.config.bits // 8 + 4 * nb
