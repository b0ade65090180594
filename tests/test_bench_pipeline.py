"""benchmarks/pipeline.py's ``--reprice``: the stored runs priced again from their stored profiles."""

from __future__ import annotations

import json
import sys

import pytest

from tests.test_cli import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import pipeline  # noqa: E402


def test_reprice_gives_the_committed_predictions_back(tmp_path, capsys):
    """The model prices the committed pipeline runs as it did when they were measured: a change to the
    pipeline model shows here, and ``pipeline.py --reprice`` then rewrites the results with the new prices."""
    results = json.loads((pipeline.RESULTS / "pipeline.json").read_text())
    before = {(k, name, i): run["predicted_step_s"] for k, r in results.items() for name, runs in r["runs"].items()
              for i, run in enumerate(runs) if run.get("predicted_step_s") is not None}
    assert len(before) >= 15
    for r in results.values():  # wiped, so a reprice that priced nothing cannot give them back
        for runs in r["runs"].values():
            for run in runs:
                if run.get("predicted_step_s") is not None:
                    run["predicted_step_s"] = -1.0
    for key in results:
        pipeline.reprice(results[key], key, tmp_path)
    after = {(k, name, i): run["predicted_step_s"] for k, r in results.items() for name, runs in r["runs"].items()
             for i, run in enumerate(runs) if run.get("predicted_step_s") is not None}
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k] == pytest.approx(v, rel=1e-9), k
    assert all(run["predicted_step_s_before"] == -1.0 for r in results.values() for runs in r["runs"].values()
               for run in runs if run.get("predicted_step_s") is not None)
    assert "predicted" in capsys.readouterr().out


def test_where_the_step_went_puts_each_stages_timed_compute_beside_the_models():
    def run(seed, comp, busy, model=None):
        clock = [{"forward_s_per_microbatch": c / 3, "backward_s_per_microbatch": 2 * c / 3, "busy": b}
                 for c, b in zip(comp, busy)]
        return {"seed": seed, "pipeline": {"stage_compute": clock}, **({"predicted_stage_s": model} if model else {})}

    runs = {"fp32": [run(0, [0.001, 0.004], [0.1, 0.5], [0.002, 0.008]), run(1, [0.003, 0.006], [0.3, 0.7],
                                                                              [0.004, 0.010])],
            "old": [{"seed": 0, "pipeline": {}}], "failed": [{"error": "x"}]}
    lines = pipeline.clock_lines(runs)
    assert "| contender | stage 0 | stage 1 |" in lines
    assert "| fp32 | 2.0 (20%) / 3.0 | 5.0 (60%) / 9.0 |" in lines  # medians over seeds: timed (busy) / model
    assert not any(l.startswith("| old") or l.startswith("| failed") for l in lines)
    assert pipeline.clock_lines({"old": [{"seed": 0, "pipeline": {}}]}) == []
