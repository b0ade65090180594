"""The step time of each sync mode, from one predicted ``allreduce`` step's parts (pure functions).

Inputs are plain seconds from :func:`thinwire.perf.model.predict_step`: ``compute_s`` (the slowest
host's compute with its noise), ``comm_s`` (wire seconds of every bucket, back to back) and
``codec_s`` (encode + decode seconds on the communication thread).

* ``allreduce``: the overlap timeline's step, as predicted (communication overlaps backward only).
* ``delayed``: Pipe-SGD's pipelined step (Li et al. 2018, https://arxiv.org/abs/1811.03619, eq. for
  K=1): step t's averaging runs while step t+1 computes, so a step takes the slower of the two
  pipelines, ``max(compute, comm + codec)``. When the host has no spare core for the communication
  thread (``codec_steals_compute``), its codec work is CPU taken from compute:
  ``max(compute + codec, comm + codec)``.
* ``local``, ``diloco``: H steps of compute alone, then one average of all parameters (the same
  bytes and codec work as one gradient average) with nothing to overlap it:
  ``compute + (comm + codec) / H`` (Lin et al. 2020; Douillard et al. 2023, whose communication cost
  is that of data parallelism divided by H).
* streaming DiLoCo (F fragments, each average in flight for T inner steps): every H/F steps one
  fragment, 1/F of the average, of which T steps of compute hide what they can:
  ``compute + max(0, (comm + codec) / F - T * compute) / (H / F)`` (Douillard et al. 2025). When the
  host has no spare core, the codec work is CPU taken from those steps and is not hidden.

* ``dynamic``: as ``local`` with an average at only some of the checks (every ``check_every``
  steps): ``compute + (comm + codec) * rate / check_every``; the rate depends on the data (Kamp et
  al. 2018), so it is priced at its most, 1, unless one is given.
* ``gossip`` (D-PSGD): compute, then an exchange with the neighbours that nothing overlaps. A rank
  sends ``degree`` copies of the parameters on its own link, where a ring all-reduce sends
  ``2 (p-1)/p`` of them: ``compute + comm * degree * p / (2 (p-1))``, ``comm`` being the all-reduce's
  wire seconds (Lian et al. 2017).

Each sync mode's class (:mod:`thinwire.compress.sync`) prices itself with these functions.

Example: 100 ms compute, 150 ms wire, 10 ms codec::

    >>> round(delayed_step_s(compute_s=0.1, comm_s=0.15, codec_s=0.01), 3)
    0.16
    >>> round(periodic_step_s(compute_s=0.1, average_s=0.16, period=8), 3)
    0.12
"""

from __future__ import annotations


def delayed_step_s(*, compute_s: float, comm_s: float, codec_s: float, codec_steals_compute: bool = False) -> float:
    """One step of one-step-stale averaging: the slower of compute and communication (see module)."""
    busy = compute_s + (codec_s if codec_steals_compute else 0.0)
    return max(busy, comm_s + codec_s)


def periodic_step_s(*, compute_s: float, average_s: float, period: int) -> float:
    """One step of local SGD or DiLoCo: compute, plus one parameter average spread over ``period`` steps."""
    if period < 1:
        raise ValueError(f"period must be an integer >= 1, got {period}")
    return compute_s + average_s / period


def streaming_step_s(*, compute_s: float, comm_s: float, codec_s: float, period: int, fragments: int, delay: int,
                     codec_steals_compute: bool = False) -> float:
    """One step of streaming DiLoCo: a fragment's average every ``period / fragments`` steps, ``delay``
    steps of compute overlapping it (see module).

    >>> round(streaming_step_s(compute_s=0.1, comm_s=0.8, codec_s=0.0, period=16, fragments=4, delay=1), 3)
    0.125
    """
    if period < 1 or fragments < 1 or period % fragments:
        raise ValueError(f"period ({period}) must be a multiple of fragments ({fragments}), both >= 1")
    every = period // fragments
    comm, codec = comm_s / fragments, codec_s / fragments
    hidden = delay * (compute_s - (codec if codec_steals_compute else 0.0))
    exposed = max(0.0, comm + codec - max(0.0, hidden)) + (codec if codec_steals_compute else 0.0)
    return compute_s + exposed / every


def gossip_step_s(*, compute_s: float, allreduce_comm_s: float, hosts: int, degree: int, overlap: bool = False) -> float:
    """One step of gossip: compute, then ``degree`` parameter copies out on this rank's link (see module);
    with ``overlap`` the copies travel during the next step's compute: the slower of the two.

    >>> round(gossip_step_s(compute_s=0.1, allreduce_comm_s=0.15, hosts=4, degree=1), 3)
    0.2
    >>> round(gossip_step_s(compute_s=0.1, allreduce_comm_s=0.15, hosts=4, degree=1, overlap=True), 3)
    0.1
    """
    p = max(2, hosts)
    comm = allreduce_comm_s * degree * p / (2 * (p - 1))
    return max(compute_s, comm) if overlap else compute_s + comm


def dynamic_step_s(*, compute_s: float, average_s: float, check_every: int, sync_rate: float) -> float:
    """One step of dynamic averaging: compute, and an average at ``sync_rate`` of the checks, one
    check every ``check_every`` steps (its one-byte vote's latency is in ``average_s``'s alpha, not
    counted apart). ``sync_rate`` 1 is the most it can cost: an average at every check.

    >>> round(dynamic_step_s(compute_s=0.1, average_s=0.16, check_every=4, sync_rate=0.25), 3)
    0.11
    """
    if check_every < 1 or not 0 <= sync_rate <= 1:
        raise ValueError(f"check_every must be >= 1 and sync_rate in [0, 1], got {check_every}, {sync_rate}")
    return compute_s + average_s * sync_rate / check_every
