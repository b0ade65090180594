"""``bfp``: block floating point, the number format of FPGA smart NICs.

Each block of ``block`` values shares one 8-bit exponent; each value keeps a signed
``mantissa_bits``-bit mantissa. With ``E = floor(log2(max|x| of the block))`` (IEEE exponent of the
block's largest magnitude, from ``torch.frexp``) and ``b = mantissa_bits``:

1. ``step = 2 ** (E - b + 2)``, the value of one mantissa unit: the largest magnitude,
   ``< 2 ** (E + 1)``, fits in ``2 ** (b - 1)`` steps;
2. ``m = round(x / step)`` (nearest, ties to even) clamped to ``[-(2**(b-1) - 1), 2**(b-1) - 1]``;
3. decode ``x_hat = m * step`` (a power-of-two scaling: exact).

Error per value: ``|x - x_hat| <= step / 2`` except at the clamp, so always ``<= step =
2 ** (e - b + 1)`` with ``e = E + 1`` the ``frexp`` exponent. ``E`` is stored as int8 clamped to
``[-128, 127]``: fp32's whole normal range; blocks smaller than ``2**-128`` round with absolute
error ``<= 2 ** (-128 - b + 1)``.

Payload: ``[m: int8 (n_blocks * block,), E: int8 (n_blocks,)]``. Mantissas are stored one per byte
whatever ``mantissa_bits`` is (the NIC packs them; here ``mantissa_bits`` sets the precision, not
the size), so the ratio is ``4 * block / (block + 1)`` = 3.76x at the default ``block=16``. Not
summable: the collective layer all-gathers payloads and decodes each.

Reference: Darvish Rouhani et al., "Pushing the Limits of Narrow Precision Inferencing at Cloud
Scale with Microsoft Floating Point" (NeurIPS 2020) for block floating point.

Example::

    >>> codec = BfpCodec(BfpConfig())
    >>> codec.roundtrip(torch.tensor([1.0, 0.5, -0.001]), Meta(numel=3)).tolist()
    [1.0, 0.5, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import (
    as_blocks, block_absmax, check_input, check_int, flat_fp32, n_blocks, param, to_dtype,
)


@dataclass(kw_only=True, frozen=True)
class BfpConfig:
    block: int = param(16, "1..65536", "values sharing one 8-bit exponent")
    mantissa_bits: int = param(8, "2..8", "bits of each signed mantissa, sign included")

    def __post_init__(self) -> None:
        check_int("bfp.block", self.block, 1, 65536, "E.g. bfp:block=16.")
        check_int("bfp.mantissa_bits", self.mantissa_bits, 2, 8, "E.g. bfp:mantissa_bits=8.")


class BfpCodec(Codec):
    """Block floating point with a shared 8-bit exponent (see the module docstring)."""

    name = "bfp"
    config_cls = BfpConfig
    summable = False

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        check_input(x, meta)
        blocks = as_blocks(flat_fp32(x), self.config.block)
        _, e = torch.frexp(block_absmax(blocks))  # absmax = f * 2**e, f in [0.5, 1)
        exponent = (e - 1).clamp_(-128, 127)
        m = (blocks / self._step(exponent).unsqueeze(1)).round_()
        limit = 2 ** (self.config.mantissa_bits - 1) - 1
        return [m.clamp_(-limit, limit).to(torch.int8).view(-1), exponent.to(torch.int8)]

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        m, exponent = payload
        x = m.view(-1, self.config.block).to(torch.float32).mul_(self._step(exponent).unsqueeze(1))
        return to_dtype(x.view(-1)[: meta.numel], meta.dtype)

    def _step(self, exponent: Tensor) -> Tensor:
        """``2 ** (E - b + 2)`` in fp32; exact (subnormal steps included), hence division not ldexp."""
        return torch.exp2(exponent.to(torch.float32) - (self.config.mantissa_bits - 2))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        nb = n_blocks(numel, self.config.block)
        return nb * self.config.block + nb
