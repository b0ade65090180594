"""Stragglers: in synchronous data parallelism the slowest host sets the pace.

Every bucket's collective waits for the last host to hand its gradients over, so a step takes the
slowest host's compute (Chen et al., "Revisiting Distributed Synchronous SGD", arXiv 1604.00981).
Three sources of slowness are modelled:

* **Unequal devices**: host ``h`` computes at ``speed[h]`` (cores, or any relative unit); the step
  uses ``max_h t / speed[h]`` (:func:`slowest_time`).
* **Co-located hosts** (an emulated cluster on one machine): hosts with CPU caps share the machine's
  cores. The Linux CFS scheduler gives cgroups of equal weight equal shares, each capped by its
  quota (https://docs.kernel.org/scheduler/sched-bwc.html): the result is the max-min fair
  ("water-filling") allocation of :func:`cpu_shares`. With ``n`` uncapped hosts on ``c`` cores
  each gets ``c / n``; a host capped below its fair share keeps its cap and leaves the rest to the
  others. This assumes every host computes at the same time, which holds in synchronous training
  where collectives line the hosts up every step.
* **Busy cores run slower**: on a virtual machine whose vCPUs share a physical core (SMT) or
  caches and memory bandwidth, ``k`` busy cores each run at ``corun[k]`` of one core's speed alone
  (measured by ``thinwire profile``); co-located hosts get ``share * corun[k]`` with ``k`` the busy
  cores (:func:`colocated_speeds`); when hosts outnumber the cores and fill them, they time-share,
  which costs more than the share (measured per number of processes, ``corun_speed``).
* **Noise**: with per-host step times of mean ``mu`` and standard deviation ``sigma``, the expected
  slowest of ``p`` is ``mu + sigma * z_p``, ``z_p = Phi^-1((p - 0.375) / (p + 0.25))`` (Blom's
  approximation of the expected maximum of ``p`` normal samples, Blom 1958; Harter 1961 tables)
  (:func:`expected_max_normal`).

    >>> cpu_shares([1.0, 0.25, 1.0], cores=2)
    [0.875, 0.25, 0.875]
    >>> round(expected_max_normal(1.0, 0.1, 2), 3)
    1.059
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence


def cpu_shares(caps: Sequence[float | None], cores: float) -> list[float]:
    """Max-min fair share of ``cores`` for hosts with CPU caps (``None``: uncapped), in cores."""
    if cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    if any(c is not None and c <= 0 for c in caps):
        raise ValueError(f"cpu caps must be > 0 or None, got {list(caps)}")
    shares = [0.0] * len(caps)
    open_hosts = set(range(len(caps)))
    left = float(cores)
    while open_hosts:
        fair = left / len(open_hosts)
        capped = {i for i in open_hosts if caps[i] is not None and caps[i] <= fair}
        if not capped:
            for i in open_hosts:
                shares[i] = fair
            break
        for i in capped:
            shares[i] = float(caps[i])
            left -= shares[i]
        open_hosts -= capped
    return shares


def colocated_speeds(shares: Sequence[float], cores: int, corun: dict[int, float] | None = None) -> list[float]:
    """Speed of hosts sharing ``cores`` cores with CPU ``shares`` (from :func:`cpu_shares`): each share
    times the measured co-run factor of the busy processes (:func:`corun_factor`).

    >>> colocated_speeds([1.0, 1.0], 2, {2: 0.8})
    [0.8, 0.8]
    >>> colocated_speeds([0.5] * 4, 2, {2: 0.95, 4: 0.8})
    [0.4, 0.4, 0.4, 0.4]
    """
    factor = corun_factor(shares, cores, corun)
    return [s * factor for s in shares]


def busy_processes(shares: Sequence[float], cores: int) -> int:
    """How many single-thread processes compete for the machine: the hosts themselves when they
    fill every core between them and outnumber the cores (they time-share), else the busy cores,
    ``min(cores, ceil(sum(shares)))``."""
    if len(shares) > cores and sum(shares) >= cores - 1e-9:
        return len(shares)
    return min(cores, max(1, math.ceil(sum(shares) - 1e-9)))


def corun_factor(shares: Sequence[float], cores: int, corun: dict[int, float] | None = None) -> float:
    """The measured speed of each of ``n = busy_processes(shares, cores)`` concurrent processes,
    relative to its fair share ``min(1, cores / n)`` of a core alone; the largest measured ``n`` not
    above it (1.0 if none). Above ``cores`` this is the cost of time-sharing (switches, caches)
    beyond the share itself."""
    corun = corun or {}
    busy = busy_processes(shares, cores)
    known = [k for k in corun if k <= busy]
    return corun[max(known)] if known else 1.0


def slowest_time(seconds_at_unit_speed: float, speeds: Sequence[float]) -> float:
    """Time of the slowest host for work that takes ``seconds_at_unit_speed`` at speed 1."""
    if not speeds or min(speeds) <= 0:
        raise ValueError(f"speeds must be a non-empty list of positive numbers, got {list(speeds)}")
    return seconds_at_unit_speed / min(speeds)


def blom_z(p: int) -> float:
    """Expected maximum of ``p`` standard normal samples (Blom's approximation; 0 for p = 1)."""
    if p < 1:
        raise ValueError(f"number of hosts must be >= 1, got {p}")
    return 0.0 if p == 1 else NormalDist().inv_cdf((p - 0.375) / (p + 0.25))


def expected_max_normal(mean: float, std: float, p: int) -> float:
    """Expected slowest of ``p`` hosts whose times are normal with ``mean`` and ``std`` (seconds)."""
    if std < 0:
        raise ValueError(f"std must be >= 0, got {std}")
    return mean + std * blom_z(p)
