"""benchmarks/compare.py's scoring: time to target at the validations and interpolated between them."""

from __future__ import annotations

import json
import sys

import pytest

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


def test_torchft_contenders_parse_and_a_malformed_one_is_refused():
    assert compare.torchft_args("torchft:localsgd:period=16") == ["--mode", "localsgd", "--period", "16"]
    assert compare.torchft_args("torchft:diloco:period=8,outer_momentum=0.8") == [
        "--mode", "diloco", "--period", "8", "--outer-momentum", "0.8"]
    for bad in ("torchft:gossip:period=4", "torchft:localsgd", "torchft:localsgd:period=4,outer_lr=1"):
        with pytest.raises(SystemExit, match="torchft:localsgd:period=H"):
            compare.torchft_args(bad)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_torchft_records_merge_the_replicas_validation_and_refuse_replicas_that_disagree(tmp_path):
    step = {"step_time_s": 0.1, "compute_s": 0.08, "comm_wait_s": 0.02, "bytes_sent": 10}
    val = {"step": 16, "samples": 512, "wall_s": 2.0, "eval_s": 0.1, "param_sum": 5.0}
    _write(tmp_path / "peer0.jsonl", [{"step": 16, **step}, {**val, "val_sum": 30.0, "val_count": 10}])
    _write(tmp_path / "peer1.jsonl", [{"step": 16, **step}, {**val, "wall_s": 2.1, "val_sum": 10.0, "val_count": 10}])
    records = compare.torchft_records(tmp_path, 2)
    assert [r for r in records if "val_loss" in r] == [{"step": 16, "samples": 512, "wall_s": 2.0, "val_loss": 2.0}]
    assert [r for r in records if "step_time_s" in r] == [{"step": 16, **step}]
    _write(tmp_path / "peer1.jsonl", [{"step": 16, **step}, {**val, "param_sum": 5.1, "val_sum": 10.0, "val_count": 10}])
    with pytest.raises(RuntimeError, match="disagree at step 16"):
        compare.torchft_records(tmp_path, 2)
