"""Energy of a training step and a run, in joules: device power x time, plus network energy per bit.

``E = PUE * sum_hosts (P_busy * busy_s + P_idle * idle_s) + bits_on_the_wire * J_per_bit``

* Device power: busy (computing, or encoding gradients) at the device's power under load, idle
  (waiting on the network) at its idle power; figures per device with their sources in
  :mod:`thinwire.perf.devices`. This is the accounting of CodeCarbon and of Zeus (You et al., NSDI
  2023) when power is not measured: power x time, times the facility's power usage effectiveness
  (PUE; 1.0 = device energy only).
* Network: ``J_PER_BIT_INTERNET`` is Aslan, Mayers, Koomey & France, "Electricity Intensity of
  Internet Data Transmission: Untangling the Estimates" (J. Industrial Ecology 22(4), 2018):
  0.06 kWh/GB for 2015, i.e. 0.06 * 3.6e6 J / 8e9 bit = 2.7e-5 J/bit. It covers the whole path
  through access and core networks (the slow wide-area links thinwire is for), the authors expect it
  to halve about every two years, and a local network costs orders of magnitude less: pass your own
  ``j_per_bit`` for a known link (``thinwire simulate --j-per-bit``).

    >>> e = step_energy(busy_s=[0.5, 0.5], step_s=1.0, busy_w=10.0, idle_w=2.0, bytes_sent=1e6, j_per_bit=1e-8)
    >>> round(e.compute_j, 3), round(e.idle_j, 3), round(e.network_j, 3)
    (10.0, 2.0, 0.08)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

KWH_J = 3.6e6
J_PER_BIT_INTERNET = 0.06 * KWH_J / 8e9  # Aslan et al. 2018, 2015 value: 2.7e-5 J/bit


@dataclasses.dataclass(frozen=True)
class EnergyEstimate:
    compute_j: float   # hosts busy (compute and codec)
    idle_j: float      # hosts waiting
    network_j: float   # bits on the wire
    pue: float = 1.0

    @property
    def total_j(self) -> float:
        return self.pue * (self.compute_j + self.idle_j) + self.network_j


def step_energy(*, busy_s: Sequence[float], step_s: float, busy_w: float, idle_w: float, bytes_sent: float,
                j_per_bit: float = J_PER_BIT_INTERNET, pue: float = 1.0) -> EnergyEstimate:
    """Energy of one step of all hosts. ``busy_s[h]``: seconds host ``h`` computes in a step of
    ``step_s``; ``bytes_sent``: bytes all hosts together put on the wire; powers in watts."""
    if step_s < 0 or min(busy_w, idle_w, bytes_sent, j_per_bit) < 0 or pue < 1:
        raise ValueError("times, powers, bytes and J/bit must be >= 0 and pue >= 1")
    busy = [min(b, step_s) for b in busy_s]
    return EnergyEstimate(compute_j=busy_w * sum(busy), idle_j=idle_w * sum(step_s - b for b in busy),
                          network_j=bytes_sent * 8 * j_per_bit, pue=pue)


def run_energy(step: EnergyEstimate, steps: int) -> EnergyEstimate:
    """A run of ``steps`` identical steps."""
    return EnergyEstimate(compute_j=step.compute_j * steps, idle_j=step.idle_j * steps,
                          network_j=step.network_j * steps, pue=step.pue)
