"""What every scheme shares: the bucket job, the two halves of a summable job, how a scheme prices a
bucket (:class:`Traffic`), and the codec and error-feedback steps the schemes are built from."""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from typing import Callable, ClassVar, NamedTuple, Sequence

import torch
from torch import Tensor

from thinwire.compress.codecs.base import Codec, Meta, checked_decoded, checked_payload
from thinwire.compress.codecs.common import all_finite


@dataclasses.dataclass
class BucketJob:
    key: str
    buf: Tensor          # the bucket, already divided by the world size; the result is written here
    step: int
    shapes: list[tuple]  # parameter shapes in bucket order (PowerSGD needs the matrices)
    layout: tuple        # (parameter index, numel) in bucket order: residuals survive re-bucketing
    codec: Codec
    state: object        # CommState: wire, feedback, compress_s, extra
    via_switch: bool = True  # where the job has a port to the switch (state.switch) and the codec is int8: use it


@dataclasses.dataclass
class Pending:
    """A job whose only collectives are all-reduces (sums) of ``tensors``, in this order, after which
    ``finish()`` gives (result, all ranks finite). The hook may issue them asynchronously."""

    tensors: list[Tensor]
    finish: Callable[[], tuple[Tensor, bool]]


Work = tuple[tuple[str, int, float], ...]  # (kernel: encode | decode | add | feedback, fp32 bytes, times)


class Traffic(NamedTuple):
    """How one bucket travels, as the performance model needs it.

    ``collectives``: (all-reduce | all-gather | all-to-all, the size argument in bytes), in order;
    ``before`` / ``after``: the codec work on this rank before the last collective and after it, as
    (kernel, fp32 bytes it runs over, how many times); ``residual_values``: fp32 entries error
    feedback keeps for the bucket (when the hook runs with error feedback); ``bytes_sent``: what this
    rank puts on the wire, counted as :class:`~thinwire.compress.wire.Wire` counts it (filled in by
    :func:`thinwire.compress.schemes.traffic`).
    """

    scheme: str
    collectives: tuple[tuple[str, int], ...]
    before: Work = ()
    after: Work = ()
    residual_values: int = 0
    bytes_sent: int = 0


class Scheme(ABC):
    """One way a bucket travels: it runs a bucket and states the collectives and work that costs.

    ``accepts(codec)`` says from the codec's traits whether this scheme moves its payloads; the
    first scheme in :data:`thinwire.compress.schemes.SCHEMES` that accepts a codec is its scheme.
    """

    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def accepts(codec: Codec) -> bool: ...

    @abstractmethod
    def run(self, job: BucketJob) -> tuple[Tensor, bool]:
        """Average the bucket across ranks; returns (result, all ranks finite)."""

    @abstractmethod
    def traffic(self, codec: Codec, numel: int, p: int, shapes: Sequence[Sequence[int]] | None = None) -> Traffic:
        """The collectives and codec work of a bucket of ``numel`` fp32 values on ``p`` ranks, exactly
        as :meth:`run` issues them and as :class:`~thinwire.compress.wire.Wire` counts them.
        ``shapes``: the bucket's parameter shapes where the scheme needs them (None: unknown)."""

    def start(self, job: BucketJob) -> Pending | None:
        """The first half of a job whose collectives are all-reduces only (the hook may issue them
        asynchronously), or None when later collectives depend on earlier results."""
        return None


def feedback_half(nbytes: int) -> tuple[str, int, float]:
    """Error feedback's two passes over the bucket (correct before, remember after): half each side."""
    return ("feedback", nbytes, 0.5)


def meta(job: BucketJob, numel: int, salt: int = 0) -> Meta:
    seed = (job.step * 1_000_003 + int(job.key) * 7919 + salt) % (2**31 - 1)
    return Meta(numel=numel, dtype=torch.float32, seed=seed, rank=job.state.wire.rank, world=job.state.wire.world)


def corrected(job: BucketJob, key: str, x: Tensor) -> Tensor:
    fb = job.state.feedback
    layout = job.layout if key == job.key else None  # only whole-bucket residuals follow parameters
    return fb.corrected(key, x, layout) if fb is not None else x.to(torch.float32, copy=True)


def remember(job: BucketJob, key: str, corrected: Tensor, sent: Tensor) -> None:
    """Error feedback keeps ``corrected - sent``, computed in ``corrected``'s memory (its owner is
    done with it)."""
    if job.state.feedback is not None:
        job.state.feedback.update(key, corrected, sent, job.layout if key == job.key else None)


def flag(x: Tensor) -> Tensor:
    return torch.tensor([0.0 if all_finite(x) else 1.0], dtype=torch.float32, device=x.device)


def encode(job: BucketJob, x: Tensor, m: Meta) -> list[Tensor]:
    t0 = time.perf_counter()
    payload = checked_payload(job.codec, job.codec.compress(x, m), m.numel)
    job.state.compress_s += time.perf_counter() - t0
    return payload


def encode_checked(job: BucketJob, x: Tensor, m: Meta) -> tuple[list[Tensor], bool]:
    """:func:`encode`, and whether ``x`` is all finite (from the encoding pass where the codec can tell)."""
    t0 = time.perf_counter()
    payload, finite = job.codec.compress_checked(x, m)
    checked_payload(job.codec, payload, m.numel)
    job.state.compress_s += time.perf_counter() - t0
    return payload, finite


def decode(job: BucketJob, payload: list[Tensor], m: Meta) -> Tensor:
    t0 = time.perf_counter()
    out = checked_decoded(job.codec, job.codec.decompress(payload, m), m.numel).to(torch.float32)
    job.state.compress_s += time.perf_counter() - t0
    return out
