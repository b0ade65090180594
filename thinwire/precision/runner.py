"""Autocast modes (bf16, fp16) and the per-step helper the training loop calls.

``bf16`` and ``fp16`` keep fp32 master weights and run eligible ops (matmuls, convolutions) in
16 bits under ``torch.autocast`` (on CPUs without AMX attention stays in fp32, where it is faster:
:mod:`thinwire.precision.attention`). bf16 has fp32's exponent range, so it needs no loss scaling.
fp16 does: small gradients underflow, so the loss is multiplied by a scale before backward
(``torch.amp.GradScaler``) and gradients are divided by it before the optimizer step. When a
scaled gradient overflows, the step is skipped and the scale halved; :class:`PrecisionRunner`
reports every such step (``step`` returns True, ``skipped_steps`` counts them, and a log record
names the step and the new scale), never applying it silently.

``int8`` and ``fp32`` need no context: int8 lives in the layers (:mod:`thinwire.precision.int8`).

Example (one training step; ``runner.step`` clips, steps the optimizer or skips)::

    runner = PrecisionRunner("bf16", torch.device("cpu"))
    with runner.context():
        loss = loss_fn(model(x), y)
    runner.backward(loss)
    skipped = runner.step(optimizer, clip=1.0)
    optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math

import torch
from torch import Tensor

from thinwire.precision import attention

log = logging.getLogger("thinwire.precision")


class Precision(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    AUTO = "auto"


AUTOCAST_DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def parse_precision(mode: str) -> Precision:
    try:
        return Precision(mode)
    except ValueError:
        raise ValueError(f"precision must be one of {', '.join(p.value for p in Precision)}, got {mode!r}") from None


def autocast_context(mode: str, device: torch.device | str):
    """``torch.autocast`` for bf16/fp16 on ``device``'s type; a no-op context for fp32 and int8."""
    dtype = AUTOCAST_DTYPES.get(parse_precision(mode))
    if dtype is None:
        return contextlib.nullcontext()
    return attention.autocast(torch.device(device).type, dtype)


class PrecisionRunner:
    """Forward context, backward and optimizer step for one precision mode.

    ``context()`` wraps the forward (autocast for bf16/fp16); ``backward(loss)`` scales the loss
    for fp16; ``step(optimizer, params, clip)`` unscales, clips the gradient norm, and steps the
    optimizer unless a gradient is non-finite. It returns True when the step was skipped (and
    logs it). ``last_grad_norm`` holds the norm before clipping. State (fp16's loss scale)
    checkpoints through ``state_dict``/``load_state_dict``.
    """

    def __init__(self, mode: str, device: torch.device | str, *, init_scale: float = 2.0**16) -> None:
        self.mode, self.device = parse_precision(mode), torch.device(device)
        assert self.mode is not Precision.AUTO, "resolve 'auto' with choose_precision first"
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=init_scale)
                       if self.mode is Precision.FP16 else None)
        self.skipped_steps, self.steps, self.last_grad_norm = 0, 0, float("nan")
        self.announce_skips = True  # a skipped step logged here (thinwire train's loop says it once, on rank 0)

    def context(self):
        return autocast_context(self.mode.value, self.device)

    def backward(self, loss: Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params=None, clip: float | None = None) -> bool:
        """Clip and step; True if the step was skipped because a gradient was inf/nan."""
        params = list(params) if params is not None else [p for g in optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, clip or math.inf)
        self.last_grad_norm = float(norm)
        finite = math.isfinite(self.last_grad_norm)
        if self.scaler is not None:
            self.scaler.step(optimizer)  # skips by itself when unscale_ found inf/nan
            self.scaler.update()
        elif finite:
            optimizer.step()
        self.steps += 1
        if not finite:
            self.skipped_steps += 1
            scale = f"; loss scale now {self.scaler.get_scale():g}" if self.scaler is not None else ""
            if self.announce_skips:
                log.warning("step %d: non-finite gradient (%s), optimizer step skipped%s",
                            self.steps, self.last_grad_norm, scale)
        return not finite

    def report(self) -> dict:
        out = {"mode": self.mode.value, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.get_scale()
        return out

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "skipped_steps": self.skipped_steps, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps, self.steps = state["skipped_steps"], state["steps"]
