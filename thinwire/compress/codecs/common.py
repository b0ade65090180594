"""Pieces shared by the codecs: fp32 views, fixed-size blocks, seeded generators, parameter checks.

Block codecs (int8, bfp, qsgd, sign) cut the flat tensor into ``ceil(numel / block)`` rows of
``block`` values, zero-padding the last one, so that the payload's shape depends on ``numel`` and
the config only (gloo's all-gather needs equal sizes on every rank).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Meta
from thinwire.config import check

FP32_MAX = torch.finfo(torch.float32).max
_U64 = (1 << 64) - 1


def param(default: Any, allowed: str, doc: str) -> Any:
    """A config field whose allowed range and meaning show up in ``codec_help()``."""
    return dataclasses.field(default=default, metadata={"allowed": allowed, "doc": doc})


def check_int(field: str, value: object, lo: int, hi: int, fix: str = "") -> None:
    """``field`` must be an ``int`` (not a bool) in ``[lo, hi]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
    check(ok, field, value, f"an integer in [{lo}, {hi}]", fix)


def check_bool(field: str, value: object) -> None:
    check(isinstance(value, bool), field, value, "true or false")


def check_ratio(field: str, value: object) -> None:
    """A kept fraction: a number in ``(0, 1]``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1
    check(ok, field, value, "in (0, 1]", "E.g. 0.01 keeps 1% of the values.")


def check_input(x: Tensor, meta: Meta) -> None:
    """Caller contract (a bug if violated): a 1-D float tensor of ``meta.numel`` elements."""
    assert x.dim() == 1 and x.numel() == meta.numel, (tuple(x.shape), meta.numel)
    assert x.is_floating_point(), x.dtype


def all_finite(t: Tensor) -> bool:
    """Whether every element of ``t`` is finite: its min and max are (NaN propagates to both, an
    infinity is one of them). One reduction pass; ``torch.isfinite(t).all()`` writes a bool tensor
    of ``t``'s size first and took 0.8 ms against 0.06 ms for 446k fp32 values on one core."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())  # Python floats: no 0-d tensor ops


def flat_fp32(x: Tensor) -> Tensor:
    """``x`` as a flat fp32 tensor; may alias ``x`` (when it already is fp32), so never write to it."""
    return x.reshape(-1).to(torch.float32)


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def as_blocks(x32: Tensor, block: int) -> Tensor:
    """``(n_blocks, block)`` view of flat ``x32``, zero-padded at the end (a copy only if padded)."""
    pad = n_blocks(x32.numel(), block) * block - x32.numel()
    if pad:
        x32 = torch.nn.functional.pad(x32, (0, pad))
    return x32.reshape(-1, block)


def block_absmax(blocks: Tensor) -> Tensor:
    """max |x| of each row without materialising ``|x|`` (``amax`` and ``amin`` are vectorised
    reductions; ``aminmax`` over short rows was 20x slower on CPU, torch 2.13)."""
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg())


def round_toward_zero(scale: Tensor) -> Tensor:
    """The next float toward zero: then ``q * scale`` with ``|q| <= L`` never exceeds ``L * (scale
    before rounding)``, so decoding the largest value of a block cannot overflow to inf."""
    return torch.nextafter(scale, torch.zeros((), dtype=scale.dtype, device=scale.device))


def mix_seed(seed: int, rank: int) -> int:
    """A 63-bit seed, distinct per (seed, rank): splitmix64's finaliser over ``seed`` then ``rank``."""
    z = (seed * 0x9E3779B97F4A7C15 + rank + 1) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) >> 1


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A fresh generator on ``device`` (the data's device, so random draws stay there)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def sparse_k(numel: int, ratio: float) -> int:
    """Entries kept by top-k / random-k: ``max(1, ceil(ratio * numel))`` (0 when ``numel == 0``).

    ``ratio * numel`` is rounded to 9 decimals first so that float noise (``0.07 * 100 ==
    7.000000000000001``) does not add an entry.
    """
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(round(ratio * numel, 9))))


def to_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` as ``dtype``, clamped to that dtype's finite range first: a reconstruction a few ulps
    above 65504 must not become inf in an fp16 gradient. Free when ``x`` already has ``dtype``."""
    if x.dtype == dtype:
        return x
    limit = torch.finfo(dtype).max
    if limit < torch.finfo(x.dtype).max:
        x = x.to(torch.float32).clamp(-limit, limit)
    return x.to(dtype)
