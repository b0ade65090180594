"""int8 quantization and the exact int8 matmul that :mod:`thinwire.precision.int8` layers use.

* :func:`quantize`: fp32 -> int8 codes and a scale, per tensor (power of two, NITI/Mandheling) or
  per row along the non-contracted axis (absmax), rounding to nearest or stochastically.
* :func:`int8_matmul`: ``torch._int_mm`` (int8 x int8 -> int32, exact) where the device has it,
  else float with one warning; every call is counted in :data:`COUNTERS` and the caller's stats.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
import warnings
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional as F

from thinwire.config import check

QMAX = 127  # symmetric range [-127, 127]: negation never overflows
_MAX_K = 2**31 // QMAX**2  # longest contraction whose int32 sum cannot overflow (133,143)
_CHUNK_K = 131072


class Scaling(str, enum.Enum):
    POW2 = "pow2"
    ROWWISE = "rowwise"


@dataclasses.dataclass(kw_only=True, frozen=True)
class Int8ComputeConfig:
    """How int8 layers quantize: ``scaling`` pow2 | rowwise; ``stochastic`` rounding of gradients."""

    scaling: Literal["pow2", "rowwise"] = "pow2"
    stochastic: bool = True

    def __post_init__(self) -> None:
        check(self.scaling in {s.value for s in Scaling}, "scaling", self.scaling,
              "one of " + ", ".join(repr(s.value) for s in Scaling))
        check(isinstance(self.stochastic, bool), "stochastic", self.stochastic, "True or False",
              "A string such as 'false' is truthy: pass the bool.")


@dataclasses.dataclass
class Int8Stats:
    """Matmuls done by int8 kernels and by the float fallback."""

    int8: int = 0
    float: int = 0

    def as_dict(self) -> dict:
        return {"int8_matmuls": self.int8, "float_matmuls": self.float}


COUNTERS = Int8Stats()  # every int8 layer in the process
_lock = threading.Lock()  # DDP may run backward on another thread


def reset_counters() -> None:
    COUNTERS.int8 = COUNTERS.float = 0


# -- quantization ----------------------------------------------------------------------------------
class Dither:
    """Uniform [0, 1) noise for stochastic rounding, read from one buffer at random offsets.

    A fresh uniform draw per element costs about as much as the int8 matmul it feeds on CPU.
    Here a tensor gets slices of a buffer of ``cap`` draws at random offsets (one slice per
    ``cap`` elements); within a slice every element has its own independent draw, across calls
    the offsets are random and the buffer is redrawn every ``refresh`` calls, so each element's
    noise is uniform and rounding stays unbiased. Memory: ``cap + slack`` fp32 values per device
    (about 4.3 MB) from the first int8 call on, counted by the memory planner (:meth:`tensors`).
    """

    def __init__(self, cap: int = 1 << 20, slack: int = 1 << 16, refresh: int = 64) -> None:
        self.cap, self.slack, self.refresh = cap, slack, refresh
        self._buf: dict[torch.device, Tensor] = {}
        self._calls = 0

    def add_(self, v: Tensor) -> Tensor:
        """``v += U[0, 1)`` elementwise, in place (``v`` contiguous)."""
        flat = v.view(-1)
        buf = self._buffer(v.device)
        span = buf.numel() - self.slack
        for start in range(0, flat.numel(), span):
            chunk = flat[start : start + span]
            off = int(torch.randint(0, buf.numel() - chunk.numel() + 1, ()))
            chunk.add_(buf[off : off + chunk.numel()])
        return v

    def _buffer(self, device: torch.device) -> Tensor:
        """The device's buffer: allocated once at its full size and redrawn in place, so the
        memory it holds is the same at every step (a buffer grown to the largest tensor so far, or
        a new one drawn while the old is still held, made the peak depend on the step: measured
        with int8 under a memory budget, a step 1.8 MB above its plan)."""
        self._calls += 1
        buf = self._buf.get(device)
        if buf is None:
            buf = self._buf[device] = torch.rand(self.cap + self.slack, device=device)
        elif self._calls % self.refresh == 0:
            buf.uniform_()
        return buf

    def state_dict(self) -> dict:
        """The noise in use and where its refresh count stands: a resume rounds as the run never stopped would."""
        return {"calls": self._calls, "buffers": {str(d): b.detach().cpu().clone() for d, b in self._buf.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self._calls = int(sd.get("calls", 0))
        self._buf = {torch.device(d): b.to(d) for d, b in sd.get("buffers", {}).items()}

    def tensors(self) -> list[Tensor]:
        return list(self._buf.values())

    def reset(self) -> None:
        """No buffer, as before the first int8 call (a precision trial's, when int8 was not chosen)."""
        self._buf, self._calls = {}, 0


DITHER = Dither()


def _round(v: Tensor, stochastic: bool) -> Tensor:
    """``v`` (already divided by its scale) to int8, in place."""
    if stochastic:
        DITHER.add_(v).floor_()
    else:
        v.round_()
    return v.clamp_(-QMAX, QMAX).to(torch.int8)


def _absmax(t: Tensor, axis: int | None) -> Tensor:
    if axis is None:
        return torch.maximum(t.amax(), -t.amin())  # cheaper than t.abs().amax(): no |t| copy
    return torch.maximum(t.amax(axis, keepdim=True), -t.amin(axis, keepdim=True))


def quantize(t: Tensor, scaling: Scaling, axis: int, stochastic: bool = False) -> tuple[Tensor, Tensor]:
    """int8 codes and fp32 scale of ``t`` (2-D) for a matmul contracting over ``axis``.

    ``pow2``: one scale ``2^ceil(log2(absmax / 127))`` (0-dim). ``rowwise``: ``absmax / 127`` per
    slice along the other axis (shape ``(m, 1)`` for axis 1, ``(1, n)`` for axis 0), so the scale
    factors out of the contraction. An all-zero slice gets scale 1; a non-finite value gives a
    non-finite scale, so non-finite inputs stay non-finite after the matmul.
    """
    t = t.float()
    if scaling is Scaling.POW2:
        amax = _absmax(t, None)
        scale = torch.exp2(torch.ceil(torch.log2(amax / QMAX)))
    else:
        scale = _absmax(t, axis) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    # contiguous: a permuted gradient (a convolution's on one sample) divides into a strided tensor
    return _round((t / scale).contiguous(), stochastic), scale


# -- the int8 matmul -------------------------------------------------------------------------------
_kernel_ok: dict[str, bool] = {}
_warned: set[str] = set()


def kernel_available(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs on this device type (probed once, cached)."""
    key = device.type
    if key not in _kernel_ok:
        ok, why = _probe(device)
        _kernel_ok[key] = ok
        if not ok and key not in _warned:
            _warned.add(key)
            warnings.warn(f"thinwire int8: no int8 matmul kernel on {key} ({why}); int8 layers compute "
                          "the same quantized values in float instead (counted as float_matmuls).",
                          RuntimeWarning, stacklevel=3)
    return _kernel_ok[key]


def _probe(device: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "_int_mm"):
        return False, f"torch {torch.__version__} has no torch._int_mm"
    try:
        a = torch.ones(32, 32, dtype=torch.int8, device=device)
        ok = bool((torch._int_mm(a, a) == 32).all())
        return ok, "" if ok else "torch._int_mm returned wrong values"
    except (RuntimeError, NotImplementedError) as e:
        return False, str(e).splitlines()[0]


def _reset_kernel_probe() -> None:
    """Forget the probe result and the warning (tests)."""
    _kernel_ok.clear()
    _warned.clear()


def _count(stats: Int8Stats | None, kind: str) -> None:
    with _lock:
        for s in (COUNTERS, stats):
            if s is not None:
                setattr(s, kind, getattr(s, kind) + 1)


def int8_matmul(a: Tensor, b: Tensor, stats: Int8Stats | None = None) -> Tensor:
    """Exact ``a @ b`` of int8 matrices (int32, or fp32 from the fallback or a split contraction).

    Through ``torch._int_mm`` where the device has it (counted ``int8``), else in float (counted
    ``float``; exact while ``k * 127^2 < 2^24``, within fp32 rounding beyond).
    """
    assert a.dtype == b.dtype == torch.int8 and a.dim() == b.dim() == 2
    if not kernel_available(a.device):
        _count(stats, "float")
        return a.float() @ b.float()
    _count(stats, "int8")
    if a.shape[1] <= _MAX_K:
        return _int_mm(a, b)
    out = None  # split the contraction so no int32 partial sum can overflow
    for s in range(0, a.shape[1], _CHUNK_K):
        part = _int_mm(a[:, s : s + _CHUNK_K], b[s : s + _CHUNK_K]).float()
        out = part if out is None else out.add_(part)
    return out


def _int_mm(a: Tensor, b: Tensor) -> Tensor:
    if a.device.type != "cuda":
        return torch._int_mm(a, b)  # oneDNN on CPU takes any shape and strides
    # cuBLASLt: rows > 16, inner and output columns multiples of 8, contiguous operands.
    m, k = a.shape
    n = b.shape[1]
    pm, pk, pn = max(17, m) - m, -k % 8, -n % 8
    a = F.pad(a, (0, pk, 0, pm)).contiguous()
    b = F.pad(b, (0, pn, 0, pk)).contiguous()
    return torch._int_mm(a, b)[:m, :n]


def _rescale(acc: Tensor, a_scale: Tensor, b_scale: Tensor) -> Tensor:
    """fp32 ``acc * a_scale * b_scale`` (scales broadcast along rows / columns), one pass if possible."""
    if a_scale.numel() == 1 or b_scale.numel() == 1:
        return torch.mul(acc, a_scale * b_scale)
    return torch.mul(acc, a_scale).mul_(b_scale)


def relative_error(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` (tests and benchmarks)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(math.ulp(0.0)))
