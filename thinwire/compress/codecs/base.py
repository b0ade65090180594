"""The codec interface: what a gradient compressor must say about itself.

A codec turns a flat gradient tensor into a list of tensors that travel (the *payload*) and back.
It never communicates and never keeps data-dependent state between calls: what the receiver needs
to decode travels inside the payload, and the rest is :class:`Meta`, which every rank knows without
communication (numel, dtype, a seed shared by all ranks for this bucket and step).

* ``summable``: payloads of different ranks can be added element-wise by an all-reduce and the sum
  decoded once (fp16, bf16, random-k values). Otherwise each rank's payload must be decoded before
  summing (int8, bfp, qsgd, sign, top-k), and the collective layer picks a scheme for that.
* ``sparse``: the payload is a subset of entries (values + positions: top-k, random-k), so past a
  density the collective layer may rather all-reduce the decoded dense tensor.
* ``needs_feedback``: whether error feedback helps. Every codec but ``bf16``: its only error is
  round-to-nearest at <= 2**-8 relative, unbiased, with fp32's exponent range (nothing flushes to
  zero), so the hook sends it without a residual, as PyTorch's bf16 hook does (``fp16`` keeps one:
  values below 6e-8 flush to zero, a bias the residual repairs).
* ``lowrank``: the payload is low-rank factors of the bucket's matrices, sent in two all-reduce
  rounds (PowerSGD); the collective layer needs the parameter shapes.
* ``candidate``: the spec under which the planner and ``auto`` consider the codec by default
  (``"topk:ratio=0.01"``), or None when it is only used when asked for by name.
* ``payload_bytes(numel, dtype)`` prices a codec without running it: it is exactly
  ``sum(t.numel() * t.element_size() for t in compress(x, meta))`` for any ``x`` of that size, so
  the performance model and the planner can use it.

Codecs take device and dtype from their input and never move tensors to a device of their own.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Meta:
    """What both ends know about a tensor without sending it.

    ``seed`` is identical on every rank for a given (step, bucket); codecs with
    ``shared_randomness`` (random-k) draw from it directly, others mix in ``rank`` so that
    stochastic-rounding noise is independent across ranks.
    """

    numel: int
    dtype: torch.dtype = torch.float32
    seed: int = 0
    rank: int = 0
    world: int = 1  # ranks whose payloads are summed (fp16 keeps each in range / world, so the sum stays finite)


class Codec(ABC):
    """Base class of all codecs. Subclasses set ``name``, ``config_cls`` and ``summable``."""

    name: ClassVar[str]
    summable: ClassVar[bool] = False
    shared_randomness: ClassVar[bool] = False
    lossless: ClassVar[bool] = False
    needs_feedback: ClassVar[bool] = True
    sparse: ClassVar[bool] = False  # payload is (values, indices): may fall back to a dense all-reduce
    lowrank: ClassVar[bool] = False  # factors of the bucket's matrices (PowerSGD): P and Q rounds
    candidate: ClassVar[str | None] = None  # the spec the planner and ``auto`` try by default (None: not tried)

    def __init__(self, config) -> None:
        self.config = config

    @abstractmethod
    def compress(self, x: Tensor, meta: Meta) -> list[Tensor]:
        """Encode flat tensor ``x`` (``x.numel() == meta.numel``) into the tensors that travel."""

    @abstractmethod
    def decompress(self, payload: list[Tensor], meta: Meta) -> Tensor:
        """Decode a payload (or, for summable codecs, a sum of payloads) into a flat tensor of
        ``meta.numel`` elements and dtype ``meta.dtype`` on the payload's device."""

    @abstractmethod
    def payload_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Exact bytes of ``compress``'s output for a tensor of ``numel`` elements of ``dtype``."""

    def compress_checked(self, x: Tensor, meta: Meta) -> tuple[list[Tensor], bool]:
        """``compress(x, meta)`` and whether every element of ``x`` is finite. A codec whose encoding
        pass already tells (a cast: a NaN or an infinity survives it) overrides it to save a pass."""
        from thinwire.compress.codecs.common import all_finite  # common imports this module

        finite = all_finite(x)
        return self.compress(x, meta), finite

    def decompress_into(self, payload: list[Tensor], meta: Meta, out: Tensor) -> Tensor:
        """``out.copy_(self.decompress(payload, meta))``; codecs that can decode without the
        temporary override it."""
        return out.copy_(self.decompress(payload, meta).view(out.shape))

    def roundtrip(self, x: Tensor, meta: Meta) -> Tensor:
        """What the receiver reconstructs from this rank's payload alone (used by error feedback)."""
        return self.decompress(self.compress(x, meta), meta)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"


def payload_nbytes(payload: list[Tensor]) -> int:
    """Bytes a list of tensors occupies on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


def checked_payload(codec: Codec, payload: list[Tensor], numel: int) -> list[Tensor]:
    """``payload`` if it holds the bytes ``codec.payload_bytes(numel)`` says: every rank receives that many, and a
    codec whose two disagree failed deep in its own decode or aborted the collective (gloo: "Received data size
    doesn't match expected size"), naming neither the codec nor the cause."""
    got, want = payload_nbytes(payload), codec.payload_bytes(numel)
    if got != want:
        raise ValueError(f"codec {codec.name}: compress gave {got} bytes for {numel} values, and payload_bytes({numel}) "
                         f"says {want}; they must agree (the receivers expect payload_bytes' count): fix the codec's "
                         "compress or its payload_bytes")
    return payload


def checked_decoded(codec: Codec, out: Tensor, numel: int) -> Tensor:
    """``out`` if it holds the ``numel`` values ``decompress`` must return (else a clear error naming the codec)."""
    if out.numel() != numel:
        raise ValueError(f"codec {codec.name}: decompress returned {out.numel()} values for a payload of {numel}; it must "
                         "return meta.numel values")
    return out

