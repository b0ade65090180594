"""benchmarks/pipeline_links.py: the committed rows are what the model and the eager reference give today."""

from __future__ import annotations

import json
import sys

import pytest

from tests.test_cli import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import pipeline_links  # noqa: E402


def test_the_committed_rows_are_the_models_prices_and_the_report_is_their_markdown():
    """A change to the pipeline model shows here: rerun ``benchmarks/pipeline_links.py`` (root) after it."""
    result = json.loads((pipeline_links.RESULTS / "pipeline_links.json").read_text())
    assert len(result["rows"]) == len(pipeline_links.CONFIGS) >= 10
    for row in result["rows"]:
        for model in ("model", "eager"):
            got = pipeline_links.predict(row["config"], result["network"], result["overhead_s"], model)
            assert got == pytest.approx(row[model], rel=1e-9), (row["label"], model)
    first = result["rows"][0]
    fitted = pipeline_links.fit_overhead(first["config"], result["network"], first["measured_s"])
    assert fitted == pytest.approx(result["overhead_s"], rel=1e-6)
    assert pipeline_links.markdown(result) == (pipeline_links.RESULTS / "pipeline_links.md").read_text()
