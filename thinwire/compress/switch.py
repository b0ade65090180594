"""Aggregation in the switch: every host sends its quantized gradient once to an aggregator on the switch
and receives the sum once (SwitchML, Sapio et al. NSDI 2021; ATP), instead of ``2(p-1)/p`` times each way
around a ring (issue 24).

The aggregator is one more rank of the job's process group, placed on the switch (the emulator's
``switch:`` in the cluster spec gives it the switch's namespace, an address on the core bridge and a
CPU quota of its own); the transport is torch.distributed's point to point (gloo or NCCL), nothing of
our own. Per bucket of ``n`` fp32 values, ``b = n_blocks(n)`` blocks of ``block`` values:

1. **Header** (each trainer, 4 int64: kind, key, n, block). The aggregator checks every trainer sent the same
   bucket, so a trainer that lost step with the others is an error naming both, not a wrong sum.
2. **Agreed scales** (each trainer sends ``b + 1`` fp32: its blocks' max |x| and a non-finite flag; the
   aggregator returns the elementwise max): every trainer quantizes block ``j`` with the same scale
   ``max_j / 127`` (rounded toward zero, as :mod:`thinwire.compress.codecs.int8`), so the int8 values of
   all trainers add up **exactly** in int32 on the aggregator: the fixed-point sum of SwitchML. A
   non-finite gradient on any trainer makes every trainer's result NaN and skips step 3 everywhere.
3. **Payload** (each trainer sends ``b * block`` int8 = ``s - 4b`` bytes of the int8 codec's ``s``): the
   aggregator sums exactly, adds its own residual for this bucket (error feedback on the way back, as
   the ring's compressed reduce-scatter keeps one for its re-encoded chunk), re-encodes the sum as int8
   with fresh block scales and sends the same ``s`` bytes to every trainer.

Bytes per trainer: ``s - 4b + 16 + 4(b + 1)`` up and ``s + 4(b + 1)`` down, against about ``2(p-1)/p * s``
each way on the ring (:mod:`thinwire.compress.schemes.decoded`): 1.5x fewer at 4 hosts, 1.75x at 8, and
2 round trips of latency instead of ``2(p-1)`` hops. The aggregator's port carries ``p`` times a host's
bytes: in the emulator it is the switch's own bridge, unshaped.

The trainer's side keeps the error-feedback contract of the hook's schemes: :meth:`SwitchPort.all_reduce`
returns the sum and what this trainer actually sent (its values at the agreed scale), so the caller's
residual is ``x - sent``.

    # a group of trainers 0..p-1 and the aggregator p, which runs serve(group, [0, ..., p-1])
    port = SwitchPort(group, aggregator=p)
    total, sent = port.all_reduce(x, key=bucket_index)   # every trainer gets the same total
    ...
    port.close()                                         # the aggregator's serve() returns

**In a training job** the trainers are torchrun's world and the aggregator is not in it: it is its own
process (:func:`main`, which ``thinwire train --cluster SPEC --aggregation switch`` starts on the switch), holding a ``TCPStore`` at its address (:data:`ENV` tells the workers
where). Each worker joins it with :func:`connect`: a gloo process group of the trainers and the
aggregator (rank ``p``), one per worker restart (prefixed by torchrun's restart count), so a worker that
failed and started again meets a fresh group; the aggregator goes to the next one when a trainer of the
current one is gone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from thinwire.compress.codecs.common import as_blocks, block_absmax, n_blocks, round_toward_zero
from thinwire.errors import ThinwireError

log = logging.getLogger(__name__)
ENV = "THINWIRE_SWITCH"  # ADDRESS:PORT of the aggregator's store, set for the workers by the launcher
QMAX = 127
BLOCK = 256           # values per block: the int8 codec's default
STOP, INT8 = 0, 1     # header kinds
# int8 bytes per chunk: a bucket's payload goes up and its sum comes down chunk by chunk, so the way down
# of chunk j overlaps the way up of chunk j+1 (both directions of every link busy, as on a ring)
CHUNK_BYTES = 64 * 1024
# how long the aggregator waits for a bucket's header: trainers may leave it idle for as long as they like
# (a validation pass, a checkpoint, `auto` sending every bucket around the ring). The job's timeout would
# end the wait, and gloo then closes the connection, so the group is lost. A trainer that dies closes its
# connection, which ends the wait at once; a hung one is stopped by its own collectives' timeout.
IDLE_WAIT = timedelta(days=365)


def header_bytes() -> int:
    return 4 * 8


def bytes_up(numel: int, block: int = BLOCK) -> int:
    """What one trainer sends per bucket (header, block maxima + flag, int8 values)."""
    b = n_blocks(numel, block)
    return header_bytes() + 4 * (b + 1) + b * block


def _quantize(blocks: Tensor, scale: Tensor) -> Tensor:
    y = blocks / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    return y.round_().clamp_(-QMAX, QMAX).to(torch.int8)


def _encode(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    blocks = as_blocks(x, block)
    scale = round_toward_zero(block_absmax(blocks) / QMAX)
    return _quantize(blocks, scale), scale


def _decode(q: Tensor, scale: Tensor, numel: int) -> Tensor:
    return (q.view(scale.numel(), -1).to(torch.float32) * scale.unsqueeze(1)).view(-1)[:numel]


class SwitchPort:
    """A trainer's side of switch aggregation (module docstring): ``group`` a process group (object)
    holding the trainers and the aggregator, ``aggregator`` its rank there."""

    def __init__(self, group, aggregator: int, block: int = BLOCK) -> None:
        self.group, self.aggregator, self.block = group, aggregator, block
        self.bytes_sent = 0
        self.calls = 0

    def all_reduce(self, x: Tensor, key: int = 0, block: int | None = None) -> tuple[Tensor, Tensor]:
        """(the sum of ``x`` over the trainers, identical on each; what this trainer sent: ``x`` at the
        agreed scales, for its error feedback). NaN everywhere if any trainer's ``x`` was not finite.
        ``block``: values per scale (default the port's; the header tells the aggregator)."""
        x = x.detach().reshape(-1).float()
        n, agg, g, block = x.numel(), self.aggregator, self.group, block or self.block
        _send(g, torch.tensor([INT8, key, n, block], dtype=torch.int64), agg)
        blocks = as_blocks(x, block)
        local = torch.cat([block_absmax(blocks), torch.tensor([0.0 if bool(torch.isfinite(x).all()) else 1.0])])
        _send(g, local.nan_to_num(nan=0.0, posinf=0.0), agg)
        agreed = torch.empty_like(local)
        _recv(g, agreed, agg)
        self.bytes_sent += bytes_up(n, block)
        self.calls += 1
        if agreed[-1] != 0:
            nan = torch.full_like(x, float("nan"))
            return nan, nan
        scale = round_toward_zero(agreed[:-1] / QMAX)
        q = _quantize(blocks, scale)
        back = [torch.empty(c * block + 4 * c, dtype=torch.uint8) for c in _chunks(q.shape[0], block)]
        works = [g.send([part.reshape(-1)], agg, j) for j, part in enumerate(_split(q, block))]
        works += [g.recv([buf], agg, j) for j, buf in enumerate(back)]
        for w in works:
            w.wait()
        q2 = torch.cat([buf[: buf.numel() // (block + 4) * block] for buf in back]).view(torch.int8)
        scale2 = torch.cat([buf[buf.numel() // (block + 4) * block:] for buf in back]).view(torch.float32)
        return _decode(q2, scale2, n), _decode(q, scale, n)

    def close(self) -> None:
        """Tell the aggregator this trainer is done (its :func:`serve` returns when every trainer is)."""
        _send(self.group, torch.tensor([STOP, 0, 0, 0], dtype=torch.int64), self.aggregator)


def serve(group, trainers: list[int]) -> int:
    """The aggregator's loop (module docstring) for the trainers' ranks ``trainers`` in ``group`` (a
    process group object), until every trainer has called :meth:`SwitchPort.close`; returns the number
    of buckets summed."""
    residuals: dict[tuple[int, int, int], Tensor] = {}
    served = 0
    while True:
        headers = _gather(group, [torch.empty(4, dtype=torch.int64) for _ in trainers], trainers, wait=IDLE_WAIT)
        kinds = {int(h[0]) for h in headers}
        if kinds == {STOP}:
            return served
        head = headers[0].tolist()
        for t, h in zip(trainers, headers):
            if h.tolist() != head:
                raise ThinwireError(f"switch aggregation: trainer rank {t} sent bucket (kind, key, values, block) "
                                    f"{tuple(h.tolist())} while rank {trainers[0]} sent {tuple(head)}; the "
                                    "trainers lost step with each other (different models or bucket layouts?)")
        _, key, n, block = head
        b = n_blocks(n, block)
        maxima = _gather(group, [torch.empty(b + 1) for _ in trainers], trainers)
        agreed = torch.stack(maxima).amax(0)
        _scatter(group, agreed, trainers)
        if agreed[-1] != 0:
            continue
        scale = round_toward_zero(agreed[:-1] / QMAX)
        residual = residuals.setdefault((key, n, block), torch.zeros(b * block))
        sizes = _chunks(b, block)
        recvs = [[(buf := torch.empty(c * block, dtype=torch.int8), group.recv([buf], t, j)) for t in trainers]
                 for j, c in enumerate(sizes)]
        sends, first = [], 0
        for j, (c, arriving) in enumerate(zip(sizes, recvs)):  # chunk by chunk: chunk j+1 arrives meanwhile
            for _, work in arriving:
                work.wait()
            out = reduce_chunk([buf for buf, _ in arriving], scale[first : first + c],
                               residual[first * block : (first + c) * block], block)
            sends += [group.send([out], t, j) for t in trainers]
            first += c
        for w in sends:
            w.wait()
        served += 1


def reduce_chunk(bufs: list[Tensor], scale: Tensor, residual: Tensor, block: int) -> Tensor:
    """The aggregator's work on one chunk: the trainers' int8 values ``bufs`` (``len(scale)`` blocks each)
    summed exactly in int32 (every trainer used the agreed ``scale``), the aggregator's ``residual`` added,
    re-encoded as int8 with fresh block scales; ``residual`` (a view of the bucket's) becomes what that
    encoding left out. Returns the bytes sent back to every trainer: the int8 values, then the scales."""
    total = torch.zeros(scale.numel() * block, dtype=torch.int32)
    for buf in bufs:
        total += buf
    corrected = (total.view(-1, block).to(torch.float32) * scale.unsqueeze(1)).view(-1)
    corrected += residual
    q2, scale2 = _encode(corrected, block)
    residual.copy_(corrected - _decode(q2, scale2, corrected.numel()))
    return torch.cat([q2.view(-1).view(torch.uint8), scale2.view(torch.uint8)])


def _chunks(blocks: int, block: int) -> list[int]:
    """Blocks per chunk of a bucket of ``blocks`` blocks: chunks of about :data:`CHUNK_BYTES` of int8."""
    per = max(1, CHUNK_BYTES // block)
    return [min(per, blocks - i) for i in range(0, blocks, per)]


def _split(q: Tensor, block: int) -> list[Tensor]:
    """``q`` (blocks x block int8) cut into the chunks of :func:`_chunks`."""
    return list(q.split(max(1, CHUNK_BYTES // block)))


def _send(group, t: Tensor, dst: int) -> None:
    group.send([t], dst, 0).wait()


def _recv(group, t: Tensor, src: int) -> None:
    group.recv([t], src, 0).wait()


def _gather(group, bufs: list[Tensor], ranks: list[int], wait: timedelta | None = None) -> list[Tensor]:
    """``bufs[i]`` from rank ``ranks[i]``; ``wait``: how long (default: the group's timeout)."""
    for w in [group.recv([buf], r, 0) for buf, r in zip(bufs, ranks)]:
        w.wait() if wait is None else w.wait(wait)
    return bufs


def _scatter(group, t: Tensor, ranks: list[int]) -> None:
    for w in [group.send([t], r, 0) for r in ranks]:
        w.wait()


def connect(rank: int, trainers: int, generation: int, timeout_s: float, block: int = BLOCK) -> SwitchPort:
    """A worker's port to the aggregator whose store :data:`ENV` names: a gloo group of the ``trainers``
    workers (this one ``rank``) and the aggregator (rank ``trainers``), for worker restart ``generation``."""
    where = os.environ.get(ENV, "")
    address, _, port = where.rpartition(":")
    if not address or not port.isdigit():
        raise ThinwireError(f"aggregation: switch needs the aggregator's address in {ENV} (ADDRESS:PORT), got "
                            f"{where!r}; `thinwire train --cluster SPEC --aggregation switch` sets it")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, int(port), is_master=False, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore(f"switch/{generation}", store), rank, trainers + 1, timeout)
    return SwitchPort(group, aggregator=trainers, block=block)


def aggregate(address: str, port: int, trainers: int, timeout_s: float) -> None:
    """The aggregator process: hold the store at ``address:port``, then serve one group per worker
    restart, forever (the launcher stops it when the job ends)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, timeout=timeout)
    generation = 0
    while True:
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(f"switch/{generation}", store), trainers,
                                          trainers + 1, timeout)
        except RuntimeError as e:  # nobody came within the timeout: keep waiting for this generation
            log.info("switch: generation %d not formed yet (%s)", generation, e)
            continue
        try:
            served = serve(group, list(range(trainers)))
            log.info("switch: generation %d done, %d buckets", generation, served)
        except (RuntimeError, ThinwireError) as e:  # a trainer died: its agent restarts the workers
            log.warning("switch: generation %d ended by %s", generation, e)
        generation += 1


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="thinwire's aggregator on the switch (started by `thinwire train "
                                            "--cluster SPEC --aggregation switch`)")
    p.add_argument("--address", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--trainers", type=int, required=True)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    aggregate(args.address, args.port, args.trainers, args.timeout)


if __name__ == "__main__":
    main()
