"""benchmarks/compare.py's scoring: time to target at the validations and interpolated between them."""

from __future__ import annotations

import sys

from tests.test_cli import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare  # noqa: E402


def test_crossing_is_interpolated_between_the_validations_around_it():
    curve = [(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)]
    assert compare.crossing(curve, 1.5) == 2.5
    assert compare.crossing(curve, 2.0) == 2.0      # a validation exactly at the threshold
    assert compare.crossing(curve, 5.0) == 1.0      # already there at the first validation
    assert compare.crossing(curve, 0.5) is None     # never reached
    assert compare.crossing([(1.0, 2.0), (2.0, 2.0), (3.0, 1.0)], 2.0) == 1.0


def test_score_gives_both_medians_and_a_seed_not_reached_counts_as_never():
    fp32 = {"contender": "torch:none", "val_curve": [[1.0, 3.0, 10], [2.0, 2.0, 20]],
            "seed_runs": {"1": [[1.0, 3.0, 10], [2.0, 2.0, 20]], "2": [[1.0, 3.0, 10], [2.0, 2.0, 20]]}}
    late = {"contender": "auto", "val_curve": [[1.0, 3.0, 10], [3.0, 1.0, 20]],
            "seed_runs": {"1": [[1.0, 3.0, 10], [3.0, 1.0, 20]], "2": [[1.0, 3.0, 10], [3.0, 2.5, 20]]}}
    cluster = {"hosts": 2, "rate": "1gbit", "seeds": [0, 1, 2], "runs": [fp32, late]}
    compare.score(cluster)
    assert fp32["median_time_to_target_s"] == 2.0 and late["median_time_to_target_s"] == 3.0
    threshold = 2.0 * (1 + compare.TOLERANCE)
    assert late["median_time_to_target_interpolated_s"] == compare.crossing([(1.0, 3.0), (3.0, 1.0)], threshold)
    assert late["reached"] == 2
