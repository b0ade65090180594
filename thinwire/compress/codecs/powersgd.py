"""``powersgd``: rank-``r`` approximation of a gradient matrix by one power iteration.

Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization"
(NeurIPS 2019); PyTorch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``.

For a gradient viewed as an ``m x n`` matrix ``M`` and a (warm-started or random) ``n x r`` ``Q``:

1. ``P = M Q``; all-reduce ``P`` (``m * r`` values); orthonormalise its columns (Gram-Schmidt);
2. ``Q = M^T P``; all-reduce ``Q`` (``n * r`` values);
3. ``M_hat = P Q^T`` (the projection of ``M`` onto the span of ``P``: ``||M - M_hat|| <= ||M||``,
   and exact when ``rank(M) <= r``).

Cost: ``(m + n) * r * 4`` bytes instead of ``m * n * 4``; worth it when that ratio exceeds
``min_compression_rate`` (:func:`should_compress`), as in PyTorch's hook. P and Q are *summable*,
but across two all-reduce rounds with a step in between: the distributed protocol lives in the
collective layer. This module holds the config, the pure math and :class:`PowerSGDCodec`, a
*local* single-rank version (one random ``Q`` seeded by ``meta.seed``, no warm start: codecs keep
no state) used by unit tests and to price the codec.

Example::

    >>> a, b = torch.randn(64, 2), torch.randn(64, 2)
    >>> x = (a @ b.T).reshape(-1)           # rank 2, viewed back as 64 x 64
    >>> x_hat = PowerSGDCodec(PowerSGDConfig(rank=2)).roundtrip(x, Meta(numel=x.numel()))
    >>> bool((x_hat - x).norm() <= 1e-4 * x.norm())
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta
from thinwire.compress.codecs.common import (
    FP32_MAX, check_bool, check_input, check_int, generator, param, to_dtype,
)
from thinwire.config import check


@dataclass(kw_only=True, frozen=True)
class PowerSGDConfig:
    rank: int = param(4, "1..1024", "rank r of the approximation")
    warm_start: bool = param(True, "true|false", "reuse last step's Q (distributed protocol only)")
    min_compression_rate: float = param(2.0, ">= 1", "send a matrix uncompressed below this ratio")

    def __post_init__(self) -> None:
        check_int("powersgd.rank", self.rank, 1, 1024, "E.g. powersgd:rank=4.")
        check_bool("powersgd.warm_start", self.warm_start)
        rate = self.min_compression_rate
        ok = isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate >= 1
        check(ok, "powersgd.min_compression_rate", rate, "a number >= 1",
              "1 compresses every matrix that gets smaller; PyTorch's default is 2.")


def orthogonalize_(m: Tensor) -> Tensor:
    """Orthonormalise the columns of ``m`` in place (reduced QR, Householder) and return it.

    Gram-Schmidt (PyTorch's ``powerSGD_hook`` at ranks up to 2, and thinwire's before) divides each column's
    leftover by its norm: where the gradient's rank is below ``r`` a column depends on the earlier ones, its
    leftover is rounding noise, and the noise normalised is a unit vector along them, so ``P`` is not orthonormal
    and ``P Q^T`` is not a projection (twice the gradient was seen, repaid by error feedback the next step).
    QR gives orthonormal columns at any rank, and no epsilon: it is scale-free (an absolute epsilon added to a
    norm shrank the columns of tiny gradients)."""
    if m.numel() == 0:
        return m
    q = torch.linalg.qr(m if m.dtype in (torch.float32, torch.float64) else m.float(), mode="reduced").Q
    return m.copy_(q)


def matrix_view(numel: int, shape: tuple[int, ...] | torch.Size) -> tuple[int, int] | None:
    """``(rows, cols)`` of a parameter of ``shape`` seen as a matrix, as PowerSGD does: a conv
    weight ``(out, in, kh, kw)`` is ``out x (in * kh * kw)``. ``None`` for 0-D and 1-D parameters
    (biases, norms), which are sent uncompressed."""
    assert math.prod(shape) == numel, (numel, tuple(shape))
    if len(shape) < 2 or numel == 0:
        return None
    return shape[0], numel // shape[0]


def near_square(numel: int) -> tuple[int, int]:
    """``(rows, cols)`` with ``rows = ceil(sqrt(numel))``, ``cols = ceil(numel / rows)``: the matrix
    a flat buffer without a shape is viewed as (zero-padded to ``rows * cols``)."""
    rows = math.isqrt(numel - 1) + 1 if numel else 0
    return rows, (-(-numel // rows) if rows else 0)


def payload_bytes_matrix(m: int, n: int, rank: int) -> int:
    """fp32 bytes of ``P`` and ``Q`` for an ``m x n`` matrix: ``(m + n) * r * 4`` with the effective
    rank ``r = min(rank, m, n)`` (a higher rank cannot help, PyTorch clamps the same way)."""
    return (m + n) * min(rank, m, n) * 4


def should_compress(m: int, n: int, rank: int, min_compression_rate: float) -> bool:
    """Whether ``m x n`` is worth compressing: ``(m + n) * r * min_compression_rate < m * n``
    (PyTorch's ``_should_compress``)."""
    return payload_bytes_matrix(m, n, rank) * min_compression_rate < m * n * 4


def sent_matrices(shapes: list[tuple[int, ...]], config: PowerSGDConfig) -> list[tuple[int, int, tuple[int, int], int]]:
    """``(index, offset, (rows, cols), rank)`` of each parameter of a flat buffer of ``shapes`` that
    PowerSGD sends as ``P, Q``: a matrix (:func:`matrix_view`) worth compressing
    (:func:`should_compress`). The others (0-D and 1-D parameters, small matrices) go uncompressed."""
    out, offset = [], 0
    for i, shape in enumerate(shapes):
        size = math.prod(shape)
        mn = matrix_view(size, shape)
        r = min(config.rank, *mn) if mn else 0
        if mn and should_compress(mn[0], mn[1], r, config.min_compression_rate):
            out.append((i, offset, mn, r))
        offset += size
    return out


def start_q(last: Tensor | None, cols: int, rank: int, warm: bool, seed: int, device: torch.device) -> Tensor:
    """This step's ``Q``, orthonormal (as PyTorch's hook): last step's (warm start) or a random one
    seeded by ``seed`` (the same on every rank, so all start from the same ``Q``).

    Orthonormal keeps ``P = M Q`` at the scale of ``M``; last step's ``Q`` is ``M^T P``, of the scale
    of the gradient, and ``M (M^T P)`` of its square: 1e-10 for entries of 1e-5, where fp32
    Gram-Schmidt on ``P`` loses precision."""
    if warm and last is not None and last.shape == (cols, rank):
        return orthogonalize_(last.to(device, copy=True))
    return orthogonalize_(torch.randn(cols, rank, generator=torch.Generator().manual_seed(seed)).to(device))


def local_approx(x: Tensor, shapes: list[tuple[int, ...]], config: PowerSGDConfig, qs: dict[int, Tensor]) -> Tensor:
    """What one rank's PowerSGD delivers for the flat gradient ``x`` of parameters of ``shapes``.

    Each matrix it sends (:func:`sent_matrices`) becomes ``P Q^T`` after one power iteration from
    :func:`start_q` (``qs[i]`` is last call's ``Q``, updated here); the other parameters pass
    unchanged. The distributed scheme does the same on the sum over ranks
    (:mod:`thinwire.compress.schemes`); ``auto`` runs this one in shadow on each rank's own gradient
    to price PowerSGD's error per matrix, as it is sent.
    """
    out = x.to(torch.float32, copy=True)
    for i, offset, (rows, cols), r in sent_matrices(shapes, config):
        m = out[offset : offset + rows * cols].view(rows, cols)
        p = orthogonalize_(m @ start_q(qs.get(i), cols, r, config.warm_start, i, x.device))
        qs[i] = m.T @ p
        m.copy_(p @ qs[i].T)
    return out


class PowerSGDCodec(Codec):
    """Local (single-rank) PowerSGD on the near-square view of a flat buffer (see module docstring).

    Payload: ``[P: fp32 (rows, r), Q: fp32 (cols, r)]``. ``M`` is scaled by ``1 / max|M|`` before
    the power iteration (so 1e30 or 1e-30 gradients neither overflow nor underflow) and the scale
    is folded back into ``Q``. ``Q``'s entries reach ``||column of M||``, so inputs above about
    ``3e38 / sqrt(rows)`` saturate: ``Q`` and the output are clamped to fp32's finite range (never
    inf or NaN, but no longer accurate).
    """

    name = "powersgd"
    lowrank = True
    candidate = "powersgd:rank=8"
    config_cls = PowerSGDConfig
    summable = True

    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        check_input(x, meta)
        rows, cols = near_square(meta.numel)
        r = min(self.config.rank, rows, cols)
        m = x.new_zeros(rows * cols, dtype=torch.float32)
        m[: meta.numel] = x
        amax = torch.maximum(m.max(), m.min().neg()) if meta.numel else m.new_ones(())
        scale = torch.where(amax > 0, amax, 1.0)
        m = m.div_(scale).view(rows, cols)
        q = torch.randn(cols, r, generator=generator(x.device, meta.seed), device=x.device)
        p = orthogonalize_(m @ q)
        return [p, (m.T @ p).mul_(scale).clamp_(-FP32_MAX, FP32_MAX)]

    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        p, q = payload
        x = (p @ q.T).view(-1)[: meta.numel]
        return to_dtype(x.nan_to_num_(0.0, FP32_MAX, -FP32_MAX), meta.dtype)

    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return payload_bytes_matrix(*near_square(numel), self.config.rank)
