"""int8 training layers: Linear and Conv2d whose three matmuls run as int8 x int8 -> int32.

A float layer does three matmuls per step: the output ``y = x W^T``, the input gradient
``dx = dy W`` and the weight gradient ``dW = dy^T x``. Here each operand is quantized to int8 on
the fly, the product runs through ``torch._int_mm`` (oneDNN on CPU, cuBLASLt on CUDA; exact
int32 accumulation) and the int32 result is scaled back to fp32. The module's parameters stay
fp32 (the master weights the optimizer updates); only compute is int8. This is the scheme of
NITI (Wang et al., 2022, https://arxiv.org/abs/1909.13271) and Mandheling (Xu et al., MobiCom
2022, https://arxiv.org/abs/2206.07509), done in PyTorch.

Scaling (``Int8ComputeConfig.scaling``):

* ``pow2`` (NITI/Mandheling): one scale per tensor, a power of two ``2^ceil(log2(absmax/127))``,
  so rescaling is a shift in integer hardware. The same int8 copy of ``x`` serves the output and
  the weight gradient, that of ``W`` the output and the input gradient.
* ``rowwise``: one absmax scale per row of each operand along its *non-contracted* dimension
  (per token and per output channel for ``x W^T``; LLM.int8's vector-wise scheme), so the int32
  product is rescaled by an outer product of scales. Finer, so more accurate, but ``x`` and ``W``
  are quantized twice (once per axis).

Rounding: forward operands round to nearest; gradients round stochastically when
``stochastic=True`` (``floor(v + u)``, ``u ~ U[0, 1)``: unbiased, so small gradients survive on
average instead of flushing to zero, the reason NITI and Mandheling use it). The uniform draws come
from a buffer redrawn every few calls and read at random offsets, which costs one read instead of
one RNG call per element (see :class:`~thinwire.precision.quant.Dither`).

Convolutions (:class:`Int8Conv2d`) are the same three matmuls over an im2col that is built from the
already-quantized input, so the ``kh * kw``-times larger unfolded matrix exists only in int8.

Memory: the tensor saved for backward is ``x`` in int8 (a quarter of fp32), plus its scale; the
input gradient of a convolution passes through one transient fp32 unfolded matrix.
Compute: the three matmuls at int8 rate plus about six elementwise passes over the operands.
Measured on AVX-512 VNNI, one thread, 1024 rows (benchmarks/precision.py): 0.7x fp32's speed at
64 wide, 1.2-1.5x at 128-512, about 2.8x from 1024 wide up.

Proof that the int8 kernels ran: every matmul increments :data:`COUNTERS` and the layer's own
``stats`` (``int8`` or ``float``); a float fallback (no ``torch._int_mm`` for the device) warns
once and counts as ``float``.

Example::

    >>> layer = Int8Linear(256, 128)
    >>> layer(torch.randn(32, 256, requires_grad=True)).sum().backward()
    >>> layer.stats.int8   # output, input gradient, weight gradient
    3
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from thinwire.precision.quant import (COUNTERS, DITHER, Int8ComputeConfig, Int8Stats, Scaling, int8_matmul, kernel_available,
                                      quantize, relative_error, reset_counters)
from thinwire.precision.quant import _rescale

__all__ = ["COUNTERS", "DITHER", "Int8ComputeConfig", "Int8Conv2d", "Int8Conv2dFunction", "Int8Linear", "Int8LinearFunction", "Int8Stats",
           "Scaling", "int8_linear", "int8_matmul", "kernel_available", "quantize", "relative_error",
           "reset_counters", "to_float_", "to_int8_"]


class Int8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` with the output, input-gradient and weight-gradient matmuls in int8.

    ``x``: (M, K), ``weight``: (N, K). Saved for backward: ``x`` as int8 codes (for the weight
    gradient) and its scale, and the fp32 ``weight`` (a parameter, so no extra memory).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, cfg: Int8ComputeConfig, stats: Int8Stats | None):
        scaling = Scaling(cfg.scaling)
        qx, sx = quantize(x, scaling, axis=1)
        qw, sw = quantize(weight, scaling, axis=1)
        y = _rescale(int8_matmul(qx, qw.t(), stats), sx, sw.t())
        if bias is not None:
            y.add_(bias)
        if scaling is Scaling.POW2:  # per-tensor codes serve both matmuls
            ctx.save_for_backward(qx, sx, weight, qw, sw)
        else:
            ctx.save_for_backward(*quantize(x, scaling, axis=0), weight)
        ctx.cfg, ctx.stats, ctx.has_bias, ctx.dtype = cfg, stats, bias is not None, x.dtype
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cfg, stats = ctx.cfg, ctx.stats
        scaling = Scaling(cfg.scaling)
        qx, sx, weight, *wq = ctx.saved_tensors
        dx = dw = db = None
        g_rows, g_cols = _grad_codes(grad, scaling, cfg.stochastic)
        if ctx.needs_input_grad[0]:
            qw, sw = wq if wq else quantize(weight, scaling, axis=0)
            qg, sg = g_rows
            dx = _rescale(int8_matmul(qg, qw, stats), sg, sw).to(ctx.dtype)
        if ctx.needs_input_grad[1]:
            qg, sg = g_cols
            dw = _rescale(int8_matmul(qg.t(), qx, stats), sg.t(), sx).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.sum(0)
        return dx, dw, db, None, None


def _grad_codes(grad: Tensor, scaling: Scaling, stochastic: bool):
    """The gradient quantized for ``dx`` (contract over axis 1) and for ``dW`` (over axis 0)."""
    if scaling is Scaling.POW2:
        codes = quantize(grad, scaling, axis=1, stochastic=stochastic)
        return codes, codes
    return (quantize(grad, scaling, axis=1, stochastic=stochastic),
            quantize(grad, scaling, axis=0, stochastic=stochastic))


def int8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: Int8ComputeConfig,
                stats: Int8Stats | None = None) -> Tensor:
    """``F.linear`` with int8 matmuls; ``x`` may have any leading dimensions."""
    lead = x.shape[:-1]
    if x.numel() == 0:  # an empty batch: nothing to quantize (its scale is undefined); the output is empty as torch's
        return F.linear(x, weight, bias)
    y = Int8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, bias, cfg, stats)
    return y.view(*lead, weight.shape[0])


# -- modules ---------------------------------------------------------------------------------------
class Int8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` (same parameters and state dict) computing in int8."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 config: Int8ComputeConfig | None = None, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.config = config or Int8ComputeConfig()
        self.stats = Int8Stats()

    @classmethod
    def from_float(cls, m: nn.Linear, config: Int8ComputeConfig) -> "Int8Linear":
        return _recast(cls, m, config)

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.weight, self.bias, self.config, self.stats)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scaling={self.config.scaling}, stochastic={self.config.stochastic}"


class Int8Conv2dFunction(torch.autograd.Function):
    """A convolution as one int8 matmul over an int8 im2col, with int8 input and weight gradients.

    The input is quantized *before* it is unfolded, so the unfolded matrix (``kh * kw`` times the
    input) exists only in int8 and only transiently; backward saves the int8 input and unfolds it
    again. Scales must factor out of each matmul, so for ``rowwise`` the input gets one scale per
    sample for the output (rows of the unfolded matrix belong to one sample) and one per input
    channel for the weight gradient (columns belong to one channel); the weight one per output
    channel and one per (channel, kernel position); the gradient one per output position and one
    per output channel. ``pow2`` uses one scale per tensor throughout.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, cfg: Int8ComputeConfig, stats, geom: tuple):
        scaling, out = Scaling(cfg.scaling), weight.shape[0]
        qx, sx = _quantize_input(x, scaling, per="sample", kernel=geom[0])
        cols = _im2col(qx, *geom)
        w2d = weight.reshape(out, -1)
        qw, sw = quantize(w2d, scaling, axis=1)
        n, (oh, ow) = x.shape[0], _conv_out(x.shape[2:], *geom)
        y = _rescale(int8_matmul(cols, qw.t(), stats), sx.repeat_interleave(oh * ow, 0) if sx.dim() else sx, sw.t())
        if bias is not None:
            y.add_(bias)
        if scaling is Scaling.POW2:
            ctx.save_for_backward(qx, sx, weight, qw, sw)
        else:
            ctx.save_for_backward(*_quantize_input(x, scaling, per="channel", kernel=geom[0]), weight)
        ctx.cfg, ctx.stats, ctx.geom, ctx.has_bias, ctx.in_shape = cfg, stats, geom, bias is not None, x.shape
        return y.view(n, oh, ow, out).permute(0, 3, 1, 2).to(x.dtype)  # channels-last strides, no copy

    @staticmethod
    def backward(ctx, grad: Tensor):
        cfg, stats, geom = ctx.cfg, ctx.stats, ctx.geom
        scaling = Scaling(cfg.scaling)
        qx, sx, weight, *wq = ctx.saved_tensors
        out = weight.shape[0]
        g2d = grad.permute(0, 2, 3, 1).reshape(-1, out)
        g_rows, g_cols = _grad_codes(g2d, scaling, cfg.stochastic)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            qw, sw = wq if wq else quantize(weight.reshape(out, -1), scaling, axis=0)
            dcols = _rescale(int8_matmul(g_rows[0], qw, stats), g_rows[1], sw)
            dx = _col2im(dcols, ctx.in_shape, *geom).to(grad.dtype)
        if ctx.needs_input_grad[1]:
            cols = _im2col(qx, *geom)
            dw = _rescale(int8_matmul(g_cols[0].t(), cols, stats), g_cols[1].t(), sx)
            dw = dw.view_as(weight).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2d.sum(0)
        return dx, dw, db, None, None, None


def _quantize_input(x: Tensor, scaling: Scaling, per: str, kernel: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """int8 codes of ``x`` (N, C, H, W) and the scale per row (``sample``: (N, 1)) or per unfolded
    column (``channel``: (1, C kh kw)); one 0-dim scale for pow2."""
    if scaling is Scaling.POW2:
        q, s = quantize(x.reshape(1, -1), scaling, axis=1)
        return q.view(x.shape), s
    if per == "sample":
        q, s = quantize(x.reshape(x.shape[0], -1), scaling, axis=1)
        return q.view(x.shape), s
    q, s = quantize(x.transpose(0, 1).reshape(x.shape[1], -1), scaling, axis=1)
    return q.view(x.shape[1], x.shape[0], *x.shape[2:]).transpose(0, 1), s.view(1, -1).repeat_interleave(
        kernel[0] * kernel[1], 1)


def _im2col(q: Tensor, kernel, dilation, padding, stride) -> Tensor:
    """(N, C, H, W) -> (N * OH * OW, C * kh * kw), any dtype (``F.unfold`` has no int8 kernel)."""
    q = F.pad(q, (padding[1], padding[1], padding[0], padding[0]))
    for dim, k, d, st in ((2, kernel[0], dilation[0], stride[0]), (3, kernel[1], dilation[1], stride[1])):
        q = q.unfold(dim, d * (k - 1) + 1, st)
    q = q[..., :: dilation[0], :: dilation[1]]  # (N, C, OH, OW, kh, kw)
    return q.permute(0, 2, 3, 1, 4, 5).reshape(-1, q.shape[1] * kernel[0] * kernel[1])


def _col2im(cols: Tensor, in_shape, kernel, dilation, padding, stride) -> Tensor:
    n = in_shape[0]
    cols = cols.view(n, -1, cols.shape[1]).transpose(1, 2)
    return F.fold(cols, tuple(in_shape[2:]), kernel, dilation, padding, stride)


def _conv_out(size, kernel, dilation, padding, stride) -> tuple[int, int]:
    return tuple((s + 2 * p - d * (k - 1) - 1) // st + 1
                 for s, k, d, p, st in zip(size, kernel, dilation, padding, stride))


class Int8Conv2d(nn.Conv2d):
    """A drop-in ``nn.Conv2d`` (same parameters and state dict) computing in int8 through an int8
    im2col (:class:`Int8Conv2dFunction`). Needs ``groups == 1`` and zero padding
    (:func:`int8_conv_supported`)."""

    def __init__(self, *args, config: Int8ComputeConfig | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.config = config or Int8ComputeConfig()
        self.stats = Int8Stats()
        why = int8_conv_supported(self)
        if why is not None:
            raise ValueError(f"Int8Conv2d: unsupported convolution, got {why}. Use nn.Conv2d for it.")

    @classmethod
    def from_float(cls, m: nn.Conv2d, config: Int8ComputeConfig) -> "Int8Conv2d":
        return _recast(cls, m, config)

    def forward(self, x: Tensor) -> Tensor:
        batched = x.dim() == 4
        if x.numel() == 0:  # an empty batch: as torch's (see int8_linear)
            return self._conv_forward(x, self.weight, self.bias)
        geom = (self.kernel_size, self.dilation, _explicit_padding(self), self.stride)
        y = Int8Conv2dFunction.apply(x if batched else x.unsqueeze(0), self.weight, self.bias, self.config,
                                     self.stats, geom)
        return y if batched else y.squeeze(0)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scaling={self.config.scaling}, stochastic={self.config.stochastic}"


def _recast(cls: type, m: nn.Module, config: Int8ComputeConfig | None) -> nn.Module:
    """A ``cls`` holding ``m``'s very Parameter objects (weight tying and optimizers survive) and hooks."""
    new = cls.__new__(cls)
    new.__dict__.update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in m.__dict__.items()})
    for k in ("config", "stats"):
        new.__dict__.pop(k, None)
    if config is not None:
        new.config, new.stats = config, Int8Stats()
    return new


def to_int8_(m: nn.Linear | nn.Conv2d, config: Int8ComputeConfig) -> nn.Module:
    """Turn ``m`` into its int8 class in place (same object, parameters, hooks); returns it."""
    m.__class__ = Int8Linear if isinstance(m, nn.Linear) else Int8Conv2d
    m.config, m.stats = config, Int8Stats()
    return m


def to_float_(m: Int8Linear | Int8Conv2d) -> nn.Module:
    """Undo :func:`to_int8_` in place."""
    m.__class__ = nn.Linear if isinstance(m, Int8Linear) else nn.Conv2d
    del m.config, m.stats
    return m


def _explicit_padding(m: nn.Conv2d) -> tuple[int, int]:
    if m.padding == "valid":
        return (0, 0)
    if m.padding == "same":
        return tuple(d * (k - 1) // 2 for d, k in zip(m.dilation, m.kernel_size))
    return tuple(m.padding)


def int8_conv_supported(m: nn.Conv2d) -> str | None:
    """Why ``m`` cannot run as :class:`Int8Conv2d`, or None if it can."""
    if m.groups != 1:
        return f"groups={m.groups} (grouped and depthwise convolutions are not one matmul)"
    if m.padding_mode != "zeros":
        return f"padding_mode={m.padding_mode!r} (only zero padding unfolds directly)"
    if m.padding == "same" and any(d * (k - 1) % 2 for d, k in zip(m.dilation, m.kernel_size)):
        return "padding='same' with an even effective kernel (asymmetric padding)"
    return None
