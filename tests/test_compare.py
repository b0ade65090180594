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


def test_a_floor_of_other_steps_gets_no_ratio_and_targets_from_sets_the_floors_targets_too():
    """Contenders run at 640 steps were divided by a floor of 480: DDP fp32 on a 640-step cosine passes its
    480-step loss at step 408, so the ratio flattered them by ~1.2x. `/ floor` needs the floor's steps, and
    --targets-from sets every cluster's targets (a 640-step floor is timed to the 480-step losses)."""
    def fp32(samples, curve):
        return {"contender": "torch:none", "val_curve": curve, "samples": samples, "median_step_s": 0.05,
                "compute_s": 0.03, "comm_wait_s": 0.02, "other_s": 0.0, "bytes_per_step": 1, "final_val_loss": curve[-1][1]}
    first = {"hosts": 4, "rate": compare.FLOOR_RATE, "seeds": [0], "runs": [fp32(480, [[10.0, 2.0, 10], [20.0, 1.0, 15]])]}
    floor = {"hosts": 4, "rate": compare.FLOOR_RATE, "seeds": [0],
             "runs": [fp32(640, [[10.0, 2.0, 10], [15.0, 1.0, 15], [25.0, 0.8, 20]])]}
    slow = {"hosts": 4, "rate": "100mbit", "seeds": [0], "runs": [{**fp32(640, [[20.0, 2.0, 10], [30.0, 1.0, 15]]),
                                                                    "contender": "int8"}]}
    head = {"command": "compare.py", "model": {}, "batch": 32, "steps": 640, "lr": 0.0015}
    results = {**head, "clusters": [floor, slow], "targets_from": "first.json", "targets_from_results": {"clusters": [first]}}
    for c in results["clusters"]:
        compare.score(c, compare.floor_of(results, c), compare.given_targets(results, c))
    assert floor["target_val_loss"] == 1.0 and floor["runs"][0]["median_time_to_target_s"] == 15.0  # not its own 0.8
    assert slow["runs"][0]["median_time_to_target_s"] == 30.0
    row = next(line for line in compare.markdown(results).splitlines() if line.startswith("| int8 "))
    assert row.split(" | ")[10] == "2.00"   # 30 s over the 640-step floor's 15 s
    results = {**head, "clusters": [first, slow]}   # the floor of 480 steps: no ratio, and a line saying why
    for c in results["clusters"]:
        compare.score(c, compare.floor_of(results, c), compare.given_targets(results, c))
    text = compare.markdown(results)
    row = next(line for line in text.splitlines() if line.startswith("| int8 "))
    assert row.split(" | ")[10] == "" and "`/ floor` left blank for int8" in text
