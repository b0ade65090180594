"""Attention under CPU autocast: fp32 where this CPU's 16-bit attention kernel is the slower one.

``torch.autocast`` puts ``scaled_dot_product_attention`` on its lower-precision list, so under bf16
autocast attention runs in bf16. PyTorch's CPU flash-attention kernel is fast in bf16 only with
AMX tiles (its bf16 path multiplies through brgemm on AMX); on CPUs without AMX it is the slower
choice. Measured on an AVX-512-BF16 CPU without AMX (torch 2.13, one thread, causal, forward +
backward; ``benchmarks/results/attention_cpu.md``)::

    shape (batch, heads, seq, head_dim)   fp32 kernel   bf16 kernel   bf16 inputs run in fp32
    (32, 4, 128, 32)                        18.9 ms       42.0 ms       20.0 ms
    (32, 8, 128, 64)                        67.9 ms      121.6 ms       84.5 ms

On such a CPU, :func:`install` moves attention to autocast's fp32 list: inputs are cast up, the
kernel runs in fp32 (which is also the more accurate choice) and the output is cast back to the
autocast dtype, so the surrounding bf16 layers see what they would have. It registers a kernel
for the ``AutocastCPU`` dispatch key and so holds for the whole process, for every autocast
region on CPU; GPUs (``AutocastCUDA``) and CPUs with AMX are left as PyTorch has them. The
charlm training step (width 128, `thinwire train`) goes from 1.08x to 1.60x fp32's speed with it
(``benchmarks/results/precision.md``).
"""

from __future__ import annotations

import logging
import warnings

import torch

log = logging.getLogger("thinwire.precision")
_LIBRARY: torch.library.Library | None = None


def bf16_attention_is_slow() -> bool:
    """True on CPUs without AMX tiles, where PyTorch's bf16 CPU flash attention loses to fp32."""
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return not (amx is not None and amx())


def _upcast(t):
    return t.float() if torch.is_tensor(t) and t.is_floating_point() else t


def _attention_in_fp32(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    low = torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", enabled=False):
        out = torch.ops.aten.scaled_dot_product_attention(
            _upcast(query), _upcast(key), _upcast(value), _upcast(attn_mask), dropout_p, is_causal, **kwargs)
    return out.to(low)


def install() -> bool:
    """Run CPU-autocast attention in fp32 on this CPU if its bf16 kernel is slower; idempotent.

    Returns True when the fp32 policy is active.
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return True
    if not bf16_attention_is_slow():
        return False
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore", UserWarning)
        lib.impl("scaled_dot_product_attention", _attention_in_fp32, "AutocastCPU")
    _LIBRARY = lib
    log.info("CPU autocast: attention runs in fp32 (this CPU has no AMX; its bf16 attention kernel is slower)")
    return True


def autocast(device_type: str, dtype: torch.dtype) -> torch.autocast:
    """``torch.autocast(device_type, dtype)``, with :func:`install`'s attention policy on CPU."""
    if device_type == "cpu":
        install()
    return torch.autocast(device_type, dtype=dtype)
