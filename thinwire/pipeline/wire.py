"""Activations and their gradients between stages, in fewer bytes: ``fp32`` (as computed), ``bf16``, or
``int8`` with one absmax scale per row (per token vector).

A stage that is not the last ends with an :class:`Encode` layer and a stage that is not the first starts
with a :class:`Decode` layer; ``torch.distributed.pipelining`` sends whatever tensor the stage returns,
so the encoded tensor is what crosses the link, forward and back:

* forward: ``Encode`` packs the activation, the link carries the packed tensor, ``Decode`` unpacks it;
* backward: ``Decode``'s backward packs the activation's gradient the same way, the link carries it
  (the schedule sends the gradient of the tensor it received), ``Encode``'s backward unpacks it.

``int8`` packs each row of C values (C even) into C bytes of int8 plus its fp32 scale (``max|x| / 127``,
rounded to nearest), the bytes viewed as a bf16 tensor of shape ``(..., C/2 + 2)`` so that
autograd and the schedule treat it as an ordinary floating-point tensor. Bytes per row: C + 4 (fp32:
4C, bf16: 2C); error per value at most half a scale. Activation quantization of this kind (8 bits,
per-token scales) keeps the loss of pipeline-parallel training (Bian et al., "Does compressing activations
help model parallel training?", MLSys 2024; AC-SGD, Wang et al., NeurIPS 2022, also quantizes the
backward's gradients).

    >>> x = torch.randn(2, 3, 8)
    >>> p = pack_int8(x); p.dtype, tuple(p.shape)
    (torch.bfloat16, (2, 3, 6))
    >>> bool((unpack_int8(p) - x).abs().max() <= x.abs().amax(-1, keepdim=True).max() / 254 + 1e-6)
    True
"""

from __future__ import annotations

import torch
from torch import nn

CODECS = ("fp32", "bf16", "int8")


def pack_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows of the last dimension as int8 with an fp32 absmax scale each, viewed as bf16 ``(..., C/2 + 2)``."""
    c = x.shape[-1]
    if c % 2:
        raise ValueError(f"pipeline activations=int8 packs rows of an even length, got {c}; use activations=bf16")
    rows = x.detach().reshape(-1, c).float()
    scale = rows.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127.0
    q = torch.round(rows / scale).clamp_(-127, 127).to(torch.int8)
    payload = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], 1)
    return payload.view(torch.bfloat16).reshape(*x.shape[:-1], -1)


def unpack_int8(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of :func:`pack_int8`."""
    c = 2 * (packed.shape[-1] - 2)
    raw = packed.detach().reshape(-1, packed.shape[-1]).view(torch.uint8)
    q = raw[:, :c].view(torch.int8).float()
    scale = raw[:, c : c + 4].contiguous().view(torch.float32)
    return (q * scale).to(dtype).reshape(*packed.shape[:-1], c)


class _Int8Encode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.dtype = x.dtype
        return pack_int8(x)

    @staticmethod
    def backward(ctx, packed_grad):
        return unpack_int8(packed_grad, ctx.dtype)


class _Int8Decode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, packed):
        return unpack_int8(packed)

    @staticmethod
    def backward(ctx, grad):
        return pack_int8(grad)


class Encode(nn.Module):
    """The last layer of a stage that sends its output on: packs it in ``codec``."""

    def __init__(self, codec: str) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_tensor(x)
        if self.codec == "bf16":
            return x.to(torch.bfloat16)
        return _Int8Encode.apply(x) if self.codec == "int8" else x


class Decode(nn.Module):
    """The first layer of a stage that receives its input: unpacks ``codec`` to fp32."""

    def __init__(self, codec: str) -> None:
        super().__init__()
        self.codec = codec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.codec == "bf16":
            return x.float()
        return _Int8Decode.apply(x) if self.codec == "int8" else x


def _check_tensor(x) -> None:
    if not torch.is_tensor(x) or not x.is_floating_point():
        raise TypeError(f"pipeline activations: a compressed link carries one floating-point tensor, got {type(x).__name__}; "
                        "use activations=fp32 for a model whose stages pass tuples or integers")


def payload_bytes(codec: str, numel: int, width: int) -> int:
    """Bytes one activation (or its gradient) of ``numel`` values in rows of ``width`` takes on the link."""
    if codec == "int8":
        return numel // width * (width + 4)
    return numel * (2 if codec == "bf16" else 4)
