"""Memory per rank of data-parallel training, in bytes.

Model states follow ZeRO's accounting (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, section 3.1): parameters, gradients and optimizer
state, per parameter. Adam/AdamW keep two fp32 moments (8 bytes); SGD with momentum one (4 bytes).
On top of that:

* DDP's gradient buckets: the reducer copies gradients into flat bucket buffers, one more fp32 copy
  of the gradients unless ``gradient_as_bucket_view=True`` (PyTorch DDP notes).
* Error-feedback residuals: one fp32 value per compressed gradient value (Seide et al. 2014), plus,
  for quantized codecs on more than two ranks, a residual of ``1/p`` of each bucket for the
  re-encoded reduced chunk (:mod:`thinwire.compress.schemes`).
* Activations saved for backward: measured (``thinwire profile`` counts the bytes autograd saves) or,
  for a GPT-style transformer, Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models" (MLSys 2023), eq. 2: ``s b h (34 + 5 a s / h)`` bytes per layer with 2-byte
  activations, for sequence ``s``, micro-batch ``b``, width ``h``, ``a`` heads
  (:func:`transformer_activation_bytes`, scaled to ``bytes_per_value``).

    >>> m = memory_per_rank(1_000_000, optimizer="adamw", residual_values=1_000_000)
    >>> m.total / 1e6
    24.0
"""

from __future__ import annotations

import dataclasses

OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8, "adamw": 8}  # fp32 state per parameter


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    params: int
    grads: int
    optimizer: int
    buckets: int
    residuals: int
    activations: int
    runtime: int = 0  # the worker process itself before its model (Python, torch): the profile's, where measured

    @property
    def total(self) -> int:
        return (self.params + self.grads + self.optimizer + self.buckets + self.residuals + self.activations
                + self.runtime)


def memory_per_rank(n_params: int, *, optimizer: str = "adamw", bytes_per_param: int = 4,
                    residual_values: int = 0, activation_bytes: int = 0,
                    gradient_as_bucket_view: bool = False, runtime_bytes: int = 0) -> MemoryEstimate:
    """Bytes one rank holds (see the module docstring). ``residual_values``: fp32 residual entries."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}")
    if min(n_params, residual_values, activation_bytes) < 0:
        raise ValueError("sizes must be >= 0")
    grads = n_params * bytes_per_param
    return MemoryEstimate(
        params=n_params * bytes_per_param, grads=grads, optimizer=n_params * OPTIMIZER_STATE_BYTES[optimizer],
        buckets=0 if gradient_as_bucket_view else n_params * 4, residuals=residual_values * 4,
        activations=activation_bytes, runtime=runtime_bytes,
    )


def residual_values(bucket_numels: list[int], *, compressed: bool, p: int, reduced_chunk: bool) -> int:
    """fp32 residual entries error feedback keeps: each compressed bucket, plus ``ceil(n/p)`` per bucket
    for the reduced chunk of a quantized codec's compressed reduce-scatter (``p > 2``)."""
    if not compressed:
        return 0
    extra = sum(-(-n // p) for n in bucket_numels) if reduced_chunk and p > 2 else 0
    return sum(bucket_numels) + extra


def transformer_activation_bytes(*, layers: int, seq: int, batch: int, width: int, heads: int,
                                 bytes_per_value: int = 4) -> int:
    """Korthikanti et al. 2023 eq. 2 (no recomputation, no parallelism), rescaled from 2-byte values.

    >>> transformer_activation_bytes(layers=1, seq=128, batch=1, width=128, heads=4, bytes_per_value=2)
    884736
    """
    per_layer_2byte = seq * batch * width * (34 + 5 * heads * seq / width)
    return int(layers * per_layer_2byte * bytes_per_value / 2)
