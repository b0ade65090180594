"""DDP's gradient buckets and how their communication overlaps backward: the step timeline.

Buckets (PyTorch ``Reducer::compute_bucket_assignment_by_size``, torch/csrc/distributed/c10d/reducer.cpp):
parameters are taken in the order their gradients become ready (after the first iteration DDP
rebuilds its buckets in that order, roughly reverse parameter order), added whole to the current
bucket, and the bucket is closed as soon as it holds ``>= limit`` bytes. The first bucket's limit is
``first_cap`` (``dist._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB when DDP is built without
``bucket_cap_mb``; with an explicit ``bucket_cap_mb``, torch 2.13 uses ``cap`` for the first bucket
too), every later one ``cap`` (25 MiB by default). Parameters are never split.

Overlap (Li et al., "PyTorch Distributed", VLDB 2020; the same rule as dPRO and Proteus): bucket
``i``'s communication starts when its last gradient is ready and bucket ``i-1``'s is done (DDP
launches buckets in order; thinwire runs them on one communication thread). Its codec's encode and
decode time lie on that path. Then::

    step = pre + max(backward end, last bucket done) + post

with ``pre`` the data loading and forward, ``post`` the gradient clip and optimizer step.

On a host whose CPU is a quota (a container's CPU limit, the emulator's ``cpu``), a collective issued
while backward still computes waits for the quota at each ring hop (``busy_wait_s[i]``: the bucket's
hops times the wait per hop that ``thinwire cluster bench --busy`` measures). The wait accrues only
while backward runs: once it ends the host is idle and the rest goes at the wire's pace, so a bucket's
communication grows by ``min(busy_wait_s[i], backward end - its start)``. When the
host has no core to spare for the communication thread (``codec_steals_compute``), codec work and
the collectives' own host CPU that run while backward is still going push the rest of backward back
by their duration (one core, two threads: the CPU time adds up).

Example: two buckets ready at 0.1 s and 0.2 s of a 0.2 s backward, 0.15 s of communication each::

    >>> t = overlap_timeline(ready_s=[0.1, 0.2], comm_s=[0.15, 0.15], backward_s=0.2)
    >>> round(t.last_done_s, 2), round(t.exposed_comm_s, 2)
    (0.4, 0.2)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024   # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024    # DDP's bucket_cap_mb=25, in MiB as DDP counts them


def ddp_bucket_assignment(param_bytes: Sequence[int], *, cap: int = DEFAULT_BUCKET_BYTES,
                          first_cap: int = DEFAULT_FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Group parameters (bytes each, in gradient-ready order) into DDP buckets of positions.

    >>> ddp_bucket_assignment([600_000, 600_000, 10, 30_000_000, 5], cap=25 * 2**20, first_cap=2**20)
    [[0, 1], [2, 3], [4]]
    """
    if cap <= 0 or first_cap <= 0:
        raise ValueError(f"bucket caps must be > 0 bytes, got cap={cap}, first_cap={first_cap}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, nbytes in enumerate(param_bytes):
        current.append(i)
        size += nbytes
        if size >= (first_cap if not buckets else cap):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclasses.dataclass(frozen=True)
class BucketSpan:
    """One bucket on the timeline; times in seconds from the start of backward."""

    index: int
    ready_s: float
    start_s: float
    encode_s: float
    comm_s: float
    decode_s: float

    @property
    def done_s(self) -> float:
        return self.start_s + self.encode_s + self.comm_s + self.decode_s


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A whole step: ``pre`` (data + forward), backward with overlapped buckets, ``post`` (optimizer)."""

    pre_s: float
    backward_s: float        # when backward's own computation ends (after any stolen codec time)
    post_s: float
    buckets: tuple[BucketSpan, ...]

    @property
    def last_done_s(self) -> float:
        return max((b.done_s for b in self.buckets), default=0.0)

    @property
    def exposed_comm_s(self) -> float:
        """Communication (and codec work) not hidden behind backward."""
        return max(0.0, self.last_done_s - self.backward_s)

    @property
    def step_s(self) -> float:
        return self.pre_s + max(self.backward_s, self.last_done_s) + self.post_s


def overlap_timeline(*, ready_s: Sequence[float], comm_s: Sequence[float], backward_s: float,
                     encode_s: Sequence[float] | None = None, decode_s: Sequence[float] | None = None,
                     comm_cpu_s: Sequence[float] | None = None, pre_s: float = 0.0, post_s: float = 0.0,
                     codec_steals_compute: bool = False, busy_wait_s: Sequence[float] | None = None) -> Timeline:
    """Simulate the buckets of one step in DDP order (see the module docstring).

    ``ready_s[i]``: seconds after backward starts when bucket ``i``'s last gradient is ready (in a
    multi-host job, on the slowest host); ``comm_s``/``encode_s``/``decode_s``: its time on the wire
    and in the codec; ``comm_cpu_s[i]``: the host CPU its collectives use while on the wire (stolen
    from backward like codec work). Returns the :class:`Timeline`.
    """
    n = len(ready_s)
    encode_s = list(encode_s) if encode_s is not None else [0.0] * n
    decode_s = list(decode_s) if decode_s is not None else [0.0] * n
    comm_cpu_s = list(comm_cpu_s) if comm_cpu_s is not None else [0.0] * n
    busy_wait_s = list(busy_wait_s) if busy_wait_s is not None else [0.0] * n
    if len(busy_wait_s) != n:
        raise ValueError(f"busy_wait_s needs one entry per bucket, got {len(busy_wait_s)} for {n}")
    if not (len(comm_s) == len(encode_s) == len(decode_s) == len(comm_cpu_s) == n):
        raise ValueError(f"ready_s, comm_s, encode_s, decode_s and comm_cpu_s need one entry per bucket, got lengths "
                         f"{n}, {len(comm_s)}, {len(encode_s)}, {len(decode_s)}, {len(comm_cpu_s)}")
    if backward_s < 0 or any(r < 0 or r > backward_s + 1e-12 for r in ready_s):
        raise ValueError(f"ready times must lie in [0, backward_s={backward_s}], got {list(ready_s)}")
    steals: list[tuple[float, float]] = []  # (when, seconds) of codec work that ran during backward
    end, link_free, spans = backward_s, 0.0, []
    for i in range(n):
        ready = _shifted(ready_s[i], steals)
        start = max(ready, link_free)
        end = _steal(start, encode_s[i], end, steals, codec_steals_compute)
        end = _steal(start + encode_s[i], comm_cpu_s[i], end, steals, codec_steals_compute)
        comm = comm_s[i] + min(busy_wait_s[i], max(0.0, end - (start + encode_s[i])))
        decode_at = start + encode_s[i] + comm
        end = _steal(decode_at, decode_s[i], end, steals, codec_steals_compute)
        spans.append(BucketSpan(i, ready, start, encode_s[i], comm, decode_s[i]))
        link_free = spans[-1].done_s
    return Timeline(pre_s=pre_s, backward_s=end, post_s=post_s, buckets=tuple(spans))


def _shifted(t: float, steals: list[tuple[float, float]]) -> float:
    """A compute event planned at ``t`` happens later by the codec time stolen before it."""
    for when, seconds in steals:
        if when < t:
            t += seconds
    return t


def _steal(at: float, seconds: float, backward_end: float, steals: list, enabled: bool) -> float:
    if enabled and seconds > 0 and at < backward_end:
        steals.append((at, seconds))
        return backward_end + seconds
    return backward_end
