"""The collectives thinwire's hook issues, each counting the bytes this rank puts on the wire.

Bytes are counted where the collective is issued, from the algorithm's per-rank traffic
(p ranks, a tensor of n bytes):

* all-reduce (ring, as gloo and NCCL use for large tensors): ``2 (p-1)/p * n`` per rank;
* all-gather of ``s`` bytes per rank: ``(p-1) * s`` (each rank's piece reaches every other rank);
* all-to-all of ``n`` bytes split in p equal chunks: ``(p-1)/p * n`` (the chunk kept is free).

These are the formulas of Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH" (2005), and of NCCL's bus-bandwidth notes. With one rank nothing is sent.
Multi-tensor payloads of mixed dtypes travel as one byte buffer (:func:`pack` / :func:`unpack`),
so a bucket costs one collective, not one per payload tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor


def ring_allreduce_bytes(nbytes: int, p: int) -> int:
    return 0 if p <= 1 else (2 * (p - 1) * nbytes) // p


def allgather_bytes(nbytes_per_rank: int, p: int) -> int:
    return (p - 1) * nbytes_per_rank


def alltoall_bytes(nbytes_total: int, p: int) -> int:
    return 0 if p <= 1 else ((p - 1) * nbytes_total) // p


def switch_bytes(nbytes: int, p: int) -> int:
    """Through the switch's aggregator (:mod:`thinwire.compress.switch`): this rank sends its ``nbytes`` once."""
    return 0 if p <= 1 else nbytes


COLLECTIVE_BYTES = {"all-reduce": ring_allreduce_bytes, "all-gather": allgather_bytes, "all-to-all": alltoall_bytes,
                    "switch": switch_bytes}


def collective_bytes(kind: str, nbytes: int, p: int) -> int:
    """Bytes this rank sends in collective ``kind`` of size argument ``nbytes`` (as :class:`Wire` counts)."""
    return COLLECTIVE_BYTES[kind](nbytes, p)


class Wire:
    """Blocking collectives on one process group, with a running count of bytes sent."""

    def __init__(self, group=None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.calls = 0

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum ``t`` in place across ranks."""
        self.bytes_sent += ring_allreduce_bytes(t.numel() * t.element_size(), self.world)
        self.calls += 1
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_reduce_async(self, t: Tensor) -> torch.futures.Future:
        self.bytes_sent += ring_allreduce_bytes(t.numel() * t.element_size(), self.world)
        self.calls += 1
        return dist.all_reduce(t, group=self.group, async_op=True).get_future()

    def all_gather(self, t: Tensor) -> list[Tensor]:
        """Every rank's ``t`` (equal shapes on all ranks), this rank's included."""
        self.bytes_sent += allgather_bytes(t.numel() * t.element_size(), self.world)
        self.calls += 1
        if self.world == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def exchange(self, t: Tensor, send_to: list[int], recv_from: list[int]) -> list[Tensor]:
        """Point to point: ``t`` to each rank of ``send_to`` while a tensor like it arrives from each
        of ``recv_from`` (ranks of this wire's group), all in flight at once; the received tensors."""
        return self.start_exchange(t, send_to, recv_from)()

    def start_exchange(self, t: Tensor, send_to: list[int], recv_from: list[int]) -> Callable[[], list[Tensor]]:
        """:meth:`exchange` started and not waited for: the returned call waits and gives the received
        tensors. ``t`` must not change until then."""
        self.bytes_sent += t.numel() * t.element_size() * len(send_to)
        self.calls += 1
        t = t.contiguous()
        got = [torch.empty_like(t) for _ in recv_from]
        ops = [dist.P2POp(dist.isend, t, self._global(r), self.group) for r in send_to]
        ops += [dist.P2POp(dist.irecv, g, self._global(r), self.group) for r, g in zip(recv_from, got)]
        works = dist.batch_isend_irecv(ops) if ops else []

        def wait() -> list[Tensor]:
            for w in works:
                w.wait()
            return got
        return wait

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_to_all(self, t: Tensor) -> Tensor:
        """Rank r receives chunk r of every rank's ``t`` (``t.shape[0]`` divisible by world size)."""
        self.bytes_sent += alltoall_bytes(t.numel() * t.element_size(), self.world)
        self.calls += 1
        if self.world == 1:
            return t.clone()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t.contiguous(), group=self.group)
        return out


def pack(tensors: list[Tensor]) -> Tensor:
    """Concatenate tensors of any dtypes into one flat uint8 buffer."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unpack(buf: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Split a buffer made by :func:`pack` back into tensors shaped and typed like ``like``."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        piece = buf[offset : offset + n]
        if (piece.storage_offset() * piece.element_size()) % t.element_size():
            piece = piece.clone()  # misaligned for a wider dtype: copy before reinterpreting
        out.append(piece.view(t.dtype).view(t.shape))
        offset += n
    return out
