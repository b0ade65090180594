"""int8 through the aggregator on the switch (:mod:`thinwire.compress.switch`), where the job has one.

Per bucket of n fp32 values: the header, the blocks' maxima and the int8 values go up once
(:func:`thinwire.compress.switch.bytes_up`), the agreed maxima and the re-encoded sum come down once. This
rank's residual is what it meant to send less what it sent at the agreed scales; the aggregator keeps
its own for the re-encoded sum. Rounding is to nearest (the agreed scales make the int8 values of all
ranks summable; stochastic rounding would be applied per rank before that, and is refused before launch).
"""

from __future__ import annotations

from torch import Tensor

from thinwire.compress import switch
from thinwire.compress.codecs.base import Codec
from thinwire.compress.schemes.base import BucketJob, Scheme, Traffic, corrected, feedback_half, remember


VIA = "@switch"  # ``auto``'s name for a codec sent through the switch (its plain name: around the ring)


def via_switch(spec: str) -> str:
    """``spec`` sent through the switch's aggregator, as ``auto`` names it among its candidates: ``int8@switch``."""
    return spec + VIA


def base_spec(spec: str) -> str:
    """The codec spec of a candidate (``int8@switch`` -> ``int8``; others unchanged)."""
    return spec.removesuffix(VIA)


def switchable(spec: str) -> bool:
    """Whether the codec of spec string ``spec`` can be summed by the switch's aggregator (int8 in 8 bits, nearest
    rounding): the one test ``simulate``, ``plan``, a plan file and ``train`` ask."""
    from thinwire.compress.spec import parse_codec_spec

    return Switched.accepts(parse_codec_spec(spec))


class Switched(Scheme):
    name = "switch"

    @staticmethod
    def accepts(codec: Codec) -> bool:
        return codec.name == "int8" and not codec.config.stochastic and codec.config.bits == 8

    def run(self, job: BucketJob) -> tuple[Tensor, bool]:
        port: switch.SwitchPort = job.state.switch
        x = corrected(job, job.key, job.buf)
        block = job.codec.config.block
        total, sent = port.all_reduce(x, key=int(job.key), block=block)
        job.state.wire.bytes_sent += switch.bytes_up(x.numel(), block)
        job.state.wire.calls += 1
        finite = not bool(total[:1].isnan().any())  # a non-finite rank makes every value NaN
        if finite:
            remember(job, job.key, x, sent)
        return job.buf.copy_(total), finite

    def traffic(self, codec: Codec, numel: int, p: int, shapes=None) -> Traffic:
        nb = 4 * numel
        fb = feedback_half(nb)
        return Traffic(self.name, (("switch", switch.bytes_up(numel, codec.config.block)),),
                       (fb, ("encode", nb, 1)), (fb, ("decode", nb, 2)), numel)  # the sum and what was sent
