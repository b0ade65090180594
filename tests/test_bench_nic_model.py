"""benchmarks/nic_model.py's arithmetic: the cases it prices, the ratios, speed-ups and the report."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import nic_model  # noqa: E402


def _row(case: dict, predicted: float, means: list[float]) -> dict:
    return {**case, "predicted_s": predicted, "runs": [{"mean_s": m, "median_s": m * 0.9} for m in means]}


def test_cases_pair_every_offload_run_with_the_spec_it_is_priced_on():
    cs = nic_model.cases(["int8", "bfp"])
    assert [c["label"] for c in cs if c["group"] == "switch"] == ["int8, ring", "int8, switch"]
    inline = [c for c in cs if c["label"].endswith("inline")]
    assert len(inline) == 2 and all(c["run_on"] == "engine" and c["priced_on"] == "engine-off"
                                    and c["train"][-2:] == ["--set", "offload=off"] for c in inline)
    assert "nic:" in nic_model.SPECS["engine"][0] and "nic:" not in nic_model.SPECS["engine-off"][0]
    assert "switch:" in nic_model.SPECS["switch"][0]
    for c in cs:  # simulate never gets train-only flags
        assert "offload=off" not in c["simulate"]


def test_summary_ratios_and_speedups():
    cs = {c["label"]: c for c in nic_model.cases(["int8"])}
    rows = [_row(cs["int8, ring"], 0.26, [0.25, 0.27, 0.20]), _row(cs["int8, switch"], 0.24, [0.20]),
            _row(cs["int8, 0.3 core + engine 0.15, offloaded"], 0.18, [0.20]),
            _row(cs["int8, 0.3 core + engine 0.15, inline"], 0.20, [0.20]),
            _row(cs["int8, 0.45 core, no engine"], 0.10, [0.14])]
    s = nic_model.summarize(rows, ["int8"])
    assert rows[0]["measured_mean_s"] == 0.25 and abs(rows[0]["ratio"] - 1.04) < 1e-9
    assert s["within_15"] == {"switch": (1, 2), "offload": (2, 3)}  # 0.24/0.20 = 1.2 and 0.10/0.14 are out
    assert abs(s["median_abs_error"]["offload"] - 0.1) < 1e-9
    pa, pb, ma, mb = s["speedups"]["switch over ring"]
    assert (pa, pb, ma, mb) == (0.26, 0.24, 0.25, 0.20)
    assert s["speedups"]["int8 offloaded over inline"] == (0.20, 0.18, 0.20, 0.20)
    result = {"command": "x", "started": "a", "ended": "b", "steps": 10, "reps": 1, "rows": rows, **s,
              "elapsed_s": 60.0, "load_average_at_end": (1.0, 1.0, 1.0)}
    md = nic_model.markdown(result)
    assert "| switch: int8, ring | 260.0 | 250.0 |" in md and "predicted speed-up 1.08x, measured 1.25x" in md


def test_reprice_prices_every_row_again_from_its_kept_profile(tmp_path, monkeypatch):
    cs = {c["label"]: c for c in nic_model.cases(["int8"])}
    rows = [_row(c, 0.1 * (i + 1), [0.25]) for i, c in enumerate(cs.values())]
    result = {"switch_cpu": 0.25, "rows": rows, **nic_model.summarize(rows, ["int8"])}
    for name in ("switch", "engine"):
        (tmp_path / f"profile-{name}.yaml").write_text("stand-in")
    priced = []

    def fake_predict(spec, profile, args):
        priced.append((spec.stem, profile.name))
        return {"predicted_s": 0.5}
    monkeypatch.setattr(nic_model, "predict", fake_predict)
    nic_model.reprice(result, tmp_path)
    assert priced == [("switch", "profile-switch.yaml"), ("switch", "profile-switch.yaml"),
                      ("engine", "profile-engine.yaml"), ("engine-off", "profile-engine.yaml"),
                      ("no-engine", "profile-engine.yaml")]
    assert [round(r["predicted_s_before"], 9) for r in rows] == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert all(r["predicted_s"] == 0.5 for r in rows) and result["within_15"]["switch"] == (0, 2)
    assert "earlier prediction: switch: int8, ring 100.0 ms" in nic_model.markdown(
        {**result, "command": "x", "started": "a", "ended": "b", "steps": 1, "reps": 1, "elapsed_s": 1.0,
         "load_average_at_end": (1.0, 1.0, 1.0)})
    (tmp_path / "profile-engine.yaml").unlink()
    try:
        nic_model.reprice(result, tmp_path)
    except SystemExit as e:
        assert "profile-engine.yaml" in str(e)
    else:
        raise AssertionError("a missing profile must stop --reprice")


def test_todays_model_gives_back_the_committed_switch_predictions(tmp_path):
    """A change to how the switch is priced shows here; `nic_model.py --reprice --name nic_model_switch`
    then rewrites the result from its kept profile."""
    import json
    import shutil

    results = ROOT / "benchmarks" / "results"
    shutil.copy(results / "nic_model_switch.json", tmp_path)
    shutil.copytree(results / "nic_model_switch_profiles", tmp_path / "nic_model_switch_profiles")
    result = json.loads((tmp_path / "nic_model_switch.json").read_text())
    for r in result["rows"]:
        r["predicted_s"] = float("nan")  # reprice must price every row again
    nic_model.reprice(result, tmp_path / "nic_model_switch_profiles")
    committed = json.loads((results / "nic_model_switch.json").read_text())
    assert [r["predicted_s"] for r in result["rows"]] == pytest.approx(
        [r["predicted_s"] for r in committed["rows"]], rel=1e-9)
