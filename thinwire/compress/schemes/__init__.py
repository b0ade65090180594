"""How each kind of payload crosses the wire: one object per way a bucket travels, which both runs a
bucket and states what that costs (its collectives, bytes and codec work), so the hook and the
performance model can never disagree.

Per bucket of n fp32 values on p ranks, with ``s = codec.payload_bytes(n)``:

============  ===================================  =====================================================
scheme        codecs (by their traits)             collectives, bytes sent per rank
============  ===================================  =====================================================
``Fp32``      ``lossless`` (none)                  all-reduce in place: ``2(p-1)/p * 4n``
``Summed``    ``summable`` (fp16, bf16, random-k)  all-reduce the payload, decode the sum once: ``2(p-1)/p * s``
``Decoded``   the others (int8, bfp, qsgd, sign,   all-gather and decode locally: ``(p-1) s``; a dense
              top-k)                               all-reduce for sparse payloads when cheaper; a
                                                   compressed reduce-scatter + all-gather for quantized
                                                   ones at p > 2 (:mod:`.decoded`)
``LowRank``   ``lowrank`` (PowerSGD)               all-reduce P (with the uncompressed vectors), then Q
============  ===================================  =====================================================

A codec is matched to the first scheme whose ``accepts`` takes its traits (:func:`scheme_for`): a new
codec needs no change here. Each payload says whether the rank's gradient was finite, so every rank
learns of it in the same collective and takes the same decision: a summable float payload in band (a
NaN in its first value makes the sum NaN everywhere), the others in an appended 4-byte flag.

Example (what a 1M-value int8 bucket costs on 4 ranks, without running it)::

    >>> from thinwire.compress.spec import parse_codec_spec
    >>> traffic(parse_codec_spec("int8"), 1_000_000, 4).collectives
    (('all-to-all', 1016096), ('all-gather', 254024))
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor

from thinwire.compress.codecs.base import Codec
from thinwire.compress.codecs.common import all_finite
from thinwire.compress.schemes.base import BucketJob, Pending, Scheme, Traffic
from thinwire.compress.wire import collective_bytes
from thinwire.compress.schemes.decoded import Decoded
from thinwire.compress.schemes.lowrank import LowRank
from thinwire.compress.schemes.summed import Fp32, Summed, flag_bytes
from thinwire.compress.schemes.switched import Switched

SCHEMES: tuple[Scheme, ...] = (Fp32(), LowRank(), Summed(), Decoded())
FP32 = SCHEMES[0]


def scheme_for(codec: Codec) -> Scheme:
    """The scheme that moves ``codec``'s payloads: the first in :data:`SCHEMES` that accepts its traits."""
    for scheme in SCHEMES:
        if scheme.accepts(codec):
            return scheme
    raise ValueError(f"no scheme moves {codec!r}")  # Decoded accepts every lossy, non-summable codec


def start(job: BucketJob) -> Pending | None:
    """The first half of a job whose collectives are all-reduces only (fp32 and summable codecs but
    low-rank), or None for the schemes whose later collectives depend on earlier results."""
    return scheme_for(job.codec).start(job)


SWITCHED = Switched()


def run(job: BucketJob) -> tuple[Tensor, bool]:
    """Average the bucket across ranks with the job's codec; returns (result, all ranks finite). A job
    whose state has a port to the switch's aggregator (``state.switch``) sends int8 through it, unless its
    policy routes the bucket around the ring (``job.via_switch``, ``Policy.via_switch``)."""
    if getattr(job.state, "switch", None) is not None and job.via_switch and SWITCHED.accepts(job.codec):
        return SWITCHED.run(job)
    return scheme_for(job.codec).run(job)


def traffic(codec: Codec, numel: int, p: int, shapes: Sequence[Sequence[int]] | None = None, *,
            uncompressed: bool = False, switch: bool = False) -> Traffic:
    """How a bucket of ``numel`` fp32 values travels with ``codec`` on ``p`` ranks (see :class:`Traffic`);
    ``uncompressed``: as the hook sends a bucket during warm-up or under ``min_compress_bytes`` (fp32);
    ``switch``: where the job has an aggregator on the switch (what :func:`run` then does)."""
    scheme = FP32 if uncompressed else SWITCHED if switch and SWITCHED.accepts(codec) else scheme_for(codec)
    t = scheme.traffic(codec, numel, p, shapes)
    return t._replace(bytes_sent=sum(collective_bytes(kind, size, p) for kind, size in t.collectives))


__all__ = ["BucketJob", "Pending", "Scheme", "Traffic", "SCHEMES", "FP32", "scheme_for", "start", "run", "traffic",
           "flag_bytes", "all_finite", "Fp32", "Summed", "Decoded", "LowRank", "Switched"]
