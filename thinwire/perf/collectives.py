"""Alpha-beta cost of the collectives data-parallel training uses, in seconds.

The alpha-beta (Hockney) model prices sending ``n`` bytes between two ranks as ``alpha + n * beta``:
``alpha`` is the per-message latency (seconds), ``beta`` the inverse bandwidth (seconds per byte,
``beta = 8 / rate_bit_per_s``). Costs below are for ``p`` ranks and are the formulas of Thakur,
Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005),
section 4, without the local reduction term unless ``gamma`` (seconds per byte reduced) is given:

===============================  ==================================================================
ring all-reduce                  ``2 (p-1) alpha + 2 (p-1)/p * n * beta``
recursive halving-doubling       ``2 log2(p) alpha + 2 (p-1)/p * n * beta (+ (p-1)/p * n * gamma)``
(Rabenseifner)                   for p a power of two; otherwise two extra exchanges of ``n``
reduce-scatter / all-gather      half of the ring all-reduce each
(ring, total ``n``)
all-gather of ``s`` per rank     ``(p-1) alpha + (p-1) * s * beta``
all-to-all (pairwise, ``n``)     ``(p-1) alpha + (p-1)/p * n * beta``
hierarchical (``g`` per group,   reduce-scatter inside groups, ring all-reduce of ``n/g`` between
``N`` groups)                    groups, all-gather inside groups: ``2 (g-1)/g n beta_in +
                                 2 (N-1)/N (n/g) beta_out + 2 (g-1) alpha_in + 2 (N-1) alpha_out``
parameter server / in-network    each host sends ``n`` and receives ``n`` (full duplex, so about
aggregation on a fat link        ``n beta`` each way); a server link shared by ``p`` hosts carries
                                 ``p n``: ``2 alpha + max(n beta_host, p n beta_server)``
                                 (SwitchML, Sapio et al., NSDI 2021: ``beta_server = 0``)
===============================  ==================================================================

On heterogeneous links a ring moves at the pace of its slowest edge: every step of the ring waits
for every pair, so ``beta`` is that of the slowest edge (:func:`ring_beta`). An edge whose traffic
crosses a link shared with other ring edges gets the link's rate divided among them.

Example (two ranks, 4 MB at 100 Mbit/s, 100 us latency)::

    >>> round(ring_allreduce_s(4e6, 2, alpha=1e-4, beta=8 / 100e6), 4)
    0.3202
"""

from __future__ import annotations

import math
from typing import Sequence


def _check(nbytes: float, p: int) -> None:
    if p < 1:
        raise ValueError(f"number of ranks must be >= 1, got {p}")
    if nbytes < 0:
        raise ValueError(f"message size must be >= 0 bytes, got {nbytes}")


def ring_allreduce_bytes(nbytes: float, p: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``nbytes``: ``2 (p-1)/p * nbytes``."""
    _check(nbytes, p)
    return 2 * (p - 1) / p * nbytes


def ring_allreduce_s(nbytes: float, p: int, *, alpha: float, beta: float) -> float:
    """Ring all-reduce (reduce-scatter + all-gather, 2(p-1) steps): ``2(p-1) alpha + 2(p-1)/p n beta``."""
    _check(nbytes, p)
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + ring_allreduce_bytes(nbytes, p) * beta


def reduce_scatter_s(nbytes: float, p: int, *, alpha: float, beta: float) -> float:
    """Ring reduce-scatter of ``nbytes`` in total: ``(p-1) alpha + (p-1)/p n beta``."""
    _check(nbytes, p)
    return 0.0 if p == 1 else (p - 1) * alpha + (p - 1) / p * nbytes * beta


def allgather_s(per_rank_bytes: float, p: int, *, alpha: float, beta: float) -> float:
    """Ring all-gather of ``s`` bytes from every rank: ``(p-1) alpha + (p-1) s beta``."""
    _check(per_rank_bytes, p)
    return 0.0 if p == 1 else (p - 1) * (alpha + per_rank_bytes * beta)


def alltoall_s(nbytes: float, p: int, *, alpha: float, beta: float) -> float:
    """Pairwise all-to-all of a ``nbytes`` buffer cut in ``p`` chunks: ``(p-1) alpha + (p-1)/p n beta``."""
    _check(nbytes, p)
    return 0.0 if p == 1 else (p - 1) * alpha + (p - 1) / p * nbytes * beta


SWITCH_CHUNK_BYTES = 64 * 1024  # thinwire.compress.switch.CHUNK_BYTES (perf/ sits below compress/)
SWITCH_MESSAGES = 4  # on the critical path: header, block maxima, agreed maxima back, then the chunks


def switch_s(nbytes: float, p: int, *, alpha: float, beta: float) -> float:
    """Through the aggregator on the switch (:mod:`thinwire.compress.switch`), ``nbytes`` sent by each
    rank: 4 messages' latency, the payload up and the re-encoded sum down chunk by chunk, both directions
    of the host's link busy at once (the way down lags one chunk): ``4 alpha + (n + min(n, chunk)) beta``.
    The aggregator's port is taken to carry ``p`` hosts' traffic at their rate; its CPU is priced apart
    (:func:`thinwire.perf.model.aggregator_s`), and the bucket takes the longer of the two."""
    _check(nbytes, p)
    return 0.0 if p == 1 else SWITCH_MESSAGES * alpha + (nbytes + min(nbytes, SWITCH_CHUNK_BYTES)) * beta


def switch_pace(seconds: float, nbytes: float, *, alpha: float) -> float:
    """The ``beta`` at which :func:`switch_s` of ``nbytes`` takes ``seconds``: a timed exchange through the
    switch, its aggregator's work included, as a pace (at least half of it counted as transfer, as
    ``auto``'s link meter does, should the latencies come out larger than the time)."""
    return max(seconds - SWITCH_MESSAGES * alpha, 0.5 * seconds) / (nbytes + min(nbytes, SWITCH_CHUNK_BYTES))


def halving_doubling_allreduce_s(nbytes: float, p: int, *, alpha: float, beta: float, gamma: float = 0.0) -> float:
    """Rabenseifner's recursive halving (reduce-scatter) then doubling (all-gather).

    For ``p`` a power of two: ``2 log2(p) alpha + 2 (p-1)/p n beta + (p-1)/p n gamma``. Otherwise the
    ``r = p - 2^floor(log2 p)`` extra ranks first hand their data to a partner and get the result
    back at the end, two more exchanges of ``n``: ``+ 2 (alpha + n beta) + n gamma`` (Thakur et al.
    2005, section 4.4).
    """
    _check(nbytes, p)
    if p == 1:
        return 0.0
    q = 1 << (p.bit_length() - 1)
    cost = 2 * math.log2(q) * alpha + 2 * (q - 1) / q * nbytes * beta + (q - 1) / q * nbytes * gamma
    if q != p:
        cost += 2 * (alpha + nbytes * beta) + nbytes * gamma
    return cost


def hierarchical_allreduce_s(nbytes: float, group_size: int, groups: int, *, alpha_in: float, beta_in: float,
                             alpha_out: float, beta_out: float) -> float:
    """Reduce-scatter inside each group of ``g`` hosts, ring all-reduce of the ``n/g`` shards across
    the ``N`` groups (``g`` rings in parallel on the inter-group links), all-gather inside groups.

    ``2 (g-1)/g n beta_in + 2 (g-1) alpha_in + 2 (N-1)/N (n/g) beta_out + 2 (N-1) alpha_out``.
    ``beta_out`` is per shard ring: if the ``g`` rings share one inter-group link, pass
    ``g * beta_link``. (Horovod / NCCL's two-level all-reduce; Jia et al., arXiv 1807.11205.)
    """
    if group_size < 1 or groups < 1:
        raise ValueError(f"group_size and groups must be >= 1, got {group_size} and {groups}")
    inside = 2 * reduce_scatter_s(nbytes, group_size, alpha=alpha_in, beta=beta_in)
    across = ring_allreduce_s(nbytes / group_size, groups, alpha=alpha_out, beta=beta_out)
    return inside + across


def parameter_server_s(nbytes: float, p: int, *, alpha: float, beta_host: float, beta_server: float) -> float:
    """Push ``n`` to an aggregator and pull the sum back (full duplex links).

    Each host's link carries ``n`` each way; the aggregator's link carries ``p n`` each way:
    ``2 alpha + max(n beta_host, p n beta_server)``. In-network aggregation (a switch that sums at
    line rate, SwitchML) is ``beta_server = 0``: about ``n beta`` whatever ``p``.
    """
    _check(nbytes, p)
    if p == 1:
        return 0.0
    return 2 * alpha + max(nbytes * beta_host, p * nbytes * beta_server)


def beta_from_rate(bit_per_s: float, efficiency: float = 1.0) -> float:
    """Seconds per byte on a link of ``bit_per_s`` of which ``efficiency`` carries payload."""
    if bit_per_s <= 0 or not 0 < efficiency <= 1:
        raise ValueError(f"rate must be > 0 bit/s and efficiency in (0, 1], got {bit_per_s} and {efficiency}")
    return 8.0 / (bit_per_s * efficiency)


def ring_edge_rates(access_bps: Sequence[float], groups: Sequence[str],
                    link_bps: dict[frozenset, float]) -> list[float]:
    """Rate (bit/s) of each edge ``i -> i+1`` of a ring over hosts in the given order.

    An edge is limited by both hosts' access links and, between groups joined by a link, by that
    link divided among the ring edges crossing it in the same direction (the link is shared, each
    way; see :mod:`thinwire.cluster.spec`).
    """
    p = len(access_bps)
    if p != len(groups):
        raise ValueError(f"access_bps and groups must have the same length, got {p} and {len(groups)}")
    edges = [(i, (i + 1) % p) for i in range(p)]
    crossings: dict[tuple[str, str], int] = {}
    for a, b in edges:
        if groups[a] != groups[b]:
            crossings[(groups[a], groups[b])] = crossings.get((groups[a], groups[b]), 0) + 1
    rates = []
    for a, b in edges:
        rate = min(access_bps[a], access_bps[b])
        link = link_bps.get(frozenset((groups[a], groups[b]))) if groups[a] != groups[b] else None
        if link is not None:
            rate = min(rate, link / crossings[(groups[a], groups[b])])
        rates.append(rate)
    return rates


def ring_beta(edge_bps: Sequence[float], efficiency: float = 1.0) -> float:
    """Seconds per byte of a ring: its slowest edge sets the pace of every step."""
    if not edge_bps:
        raise ValueError("a ring needs at least one edge")
    return beta_from_rate(min(edge_bps), efficiency)
