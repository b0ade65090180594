"""Cast codecs: send the gradient as fp32 (``none``), fp16 or bf16.

All three are *summable*: payloads of all ranks can be added by one all-reduce in the wire dtype
and decoded once, like PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``.

============  ==============  =====================================  =========================
codec         bytes / value   error (per value, normal range)        range
============  ==============  =====================================  =========================
``none``      4               0 (lossless)                           fp32
``fp16``      2               relative <= 2**-11 (~4.9e-4)           clamped to +-65504
``bf16``      2               relative <= 2**-8  (~3.9e-3)           clamped to +-3.39e38
============  ==============  =====================================  =========================

The collective layer divides by the world size *before* compressing, and fp16 clamps each of p
ranks' payloads to +-65504 / p, so the fp16 sum of all of them stays in range: an average past
65504 arrives clamped, the rest held back by error feedback, never as inf or NaN. fp16 values
below 6.1e-5 lose relative precision (subnormals) and below 6e-8 flush to zero: gradients with tiny
magnitudes should prefer ``bf16``. Values outside the finite range are clamped (never inf), so one
huge gradient cannot poison the whole sum.

Example::

    >>> codec = Fp16Codec(Fp16Config())
    >>> x = torch.tensor([1.0, -2.5, 1e6])
    >>> codec.roundtrip(x, Meta(numel=3)).tolist()
    [1.0, -2.5, 65504.0]
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import all_finite, check_input, to_dtype


@dataclass(kw_only=True, frozen=True)
class NoneConfig:
    """``none`` has no parameters."""


@dataclass(kw_only=True, frozen=True)
class Fp16Config:
    """``fp16`` has no parameters."""


@dataclass(kw_only=True, frozen=True)
class Bf16Config:
    """``bf16`` has no parameters."""


class _CastCodec(Codec):
    """Payload: one tensor of ``numel`` values in ``wire_dtype`` (never aliasing the input)."""

    wire_dtype: ClassVar[torch.dtype]
    summable = True

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        if self.wire_dtype == torch.float32:  # a copy: the collective may all-reduce in place
            check_input(x, meta)
            return [torch.empty(meta.numel, dtype=torch.float32, device=x.device).copy_(x)]
        return self.compress_checked(x, meta)[0]  # the check is the one the clamp needs anyway

    def compress_checked(self, x: Tensor, meta: Meta) -> tuple[list[Tensor], bool]:
        """The payload, and whether ``x`` is all finite, told by the payload: a NaN or an infinity
        survives the cast, so one pass over the (smaller) payload answers for the input. Only when it
        finds one does the input get a pass of its own (a finite value past the wire dtype's range
        rounds to an infinity: clamped, and the input counts as finite)."""
        if self.wire_dtype == torch.float32:
            (out,) = self.compress(x, meta)
            return [out], all_finite(out)
        check_input(x, meta)
        # One rounding to the wire dtype, then overflow (inf) back to the largest finite value:
        # same result as clamping first, without an fp32 temporary. NaN stays NaN.
        out = x.reshape(-1).to(self.wire_dtype, copy=True)  # copy: fp16 input must not alias
        limit = torch.finfo(self.wire_dtype).max
        finite = all_finite(out)
        if not finite:
            out.nan_to_num_(nan=math.nan, posinf=limit, neginf=-limit)
            finite = all_finite(x)
        if meta.world > 1 and limit < torch.finfo(torch.float32).max:  # fp16: the ranks' sum must stay in range too
            bound = _bound(self.wire_dtype, meta.world)
            out.clamp_(-bound, bound)  # (NaN stays NaN: a non-finite rank still shows)
        return [out], finite

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        return to_dtype(payload[0], meta.dtype)

    def decompress_into(self, payload: list[Tensor], meta: Meta, out: Tensor) -> Tensor:
        return out.copy_(payload[0].view(out.shape))

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * self.wire_dtype.itemsize


@functools.cache  # per bucket and step on the hot path: computed once per world size
def _bound(dtype: torch.dtype, world: int) -> float:
    """The largest value of ``dtype`` that ``world`` ranks can sum without passing its range (65504 / 3 rounds
    up to 21840 in fp16, and three of those overflow)."""
    limit = torch.finfo(dtype).max
    bound = torch.tensor(limit / world, dtype=dtype)
    while float(bound) * world > limit:
        bound = torch.nextafter(bound, torch.zeros((), dtype=dtype))
    return float(bound)


class NoneCodec(_CastCodec):
    """No compression: fp32 on the wire (4 bytes/value), lossless for fp32/fp16/bf16 gradients."""

    name = "none"
    candidate = "none"
    config_cls = NoneConfig
    wire_dtype = torch.float32
    lossless = True


class Fp16Codec(_CastCodec):
    """IEEE half on the wire (2 bytes/value, 2x): relative error <= 2**-11, clamped to +-65504."""

    name = "fp16"
    config_cls = Fp16Config
    wire_dtype = torch.float16


class Bf16Codec(_CastCodec):
    """bfloat16 on the wire (2 bytes/value, 2x): fp32's range, relative error <= 2**-8."""

    name = "bf16"
    candidate = "bf16"
    config_cls = Bf16Config
    needs_feedback = False  # unbiased rounding, fp32's range: see the base module's docstring
    wire_dtype = torch.bfloat16
