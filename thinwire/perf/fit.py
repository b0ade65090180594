"""The one line the model fits through measurements: compute phases against the batch size, codec
seconds against bytes.

``y = intercept + slope * x`` by least squares with ``slope >= 0`` (a cost that falls with more work is
measurement noise, and would make a host look faster with more samples); with fewer than two distinct
``x``, a line through the origin at the mean of ``y / x``.

    >>> [round(v, 6) for v in monotone_line([(8, 0.10), (16, 0.18)])]
    [0.02, 0.01]
    >>> monotone_line([(8, 0.2)])
    (0.0, 0.025)
"""

from __future__ import annotations

import statistics
from typing import Sequence


def monotone_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the line through ``points`` (see the module docstring)."""
    if not points:
        raise ValueError("monotone_line needs at least one (x, y) point")
    xs = [float(x) for x, _ in points]
    ys = [float(y) for _, y in points]
    if len(set(xs)) < 2:
        return 0.0, statistics.fmean(y / x if x else 0.0 for x, y in zip(xs, ys))
    slope, _ = statistics.linear_regression(xs, ys)
    slope = max(0.0, slope)
    return statistics.fmean(ys) - slope * statistics.fmean(xs), slope
