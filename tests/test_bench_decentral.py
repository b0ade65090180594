"""benchmarks/decentral.py's arithmetic: the drift recovery rule, the verdicts and the report from runs."""

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decentral  # noqa: E402


def _run(curve, mb=10.0, syncs=None, acc=0.9):
    return {"final_val_loss": curve[-1][1], "val_curve": [(float(s), loss, s) for s, loss in curve],
            "bytes_all_ranks": mb * 1e6, "wire_bytes": mb * 1.1e6, "mean_step_s": 0.01, "median_step_s": 0.01,
            "final_val_accuracy": acc, "sync": {} if syncs is None else {"syncs": syncs, "checks": 75}}


def test_recovery_step_is_the_first_evaluation_back_at_the_pre_drift_loss():
    r = _run([(140, 0.30), (150, 2.0), (160, 0.50), (170, 0.301), (180, 0.29)])
    assert decentral.recovery_step(r, 150) == 170        # 0.301 is within 0.5% of 0.30
    assert decentral.recovery_step(_run([(140, 0.3), (150, 2.0), (160, 0.4)]), 150) == math.inf
    assert decentral.recovery_step(_run([(160, 0.3)]), 150) == math.inf   # nothing before the drift


def test_skew_verdict_needs_the_loss_or_the_accuracy_and_the_bytes(tmp_path):
    periodic = _run([(300, 0.200)], mb=100)
    data = {"seeds": [0, 1, 2], "commands": ["x"], "commits": ["abc"], "started": "s", "ended": "e",
            "scenarios": {"skew": {"runs": {}, "targets": {}}}}
    runs = data["scenarios"]["skew"]["runs"]
    for k in (0, 1, 2):
        runs[f"{decentral.DYNAMIC[0]}@{k}"] = _run([(300, 0.201)], mb=9, syncs=7)
        runs[f"{decentral.PERIODIC[0]}@{k}"] = periodic
        runs[f"{decentral.POSTLOCAL4[0]}@{k}"] = periodic
    lines = decentral.verdicts(data)
    assert len(lines) == 2 and all("**met by loss and accuracy**" in line and "11.1x fewer" in line for line in lines)
    for k in (0, 1, 2):  # the issue asks for the loss "(or accuracy)": 1.5% worse in loss, as accurate
        runs[f"{decentral.DYNAMIC[0]}@{k}"] = _run([(300, 0.203)], mb=9, syncs=7)
    lines = decentral.verdicts(data)
    assert all("**met by accuracy**" in line and "loss +1.5%, accuracy +0.0%" in line for line in lines)
    for k in (0, 1, 2):
        runs[f"{decentral.DYNAMIC[0]}@{k}"] = _run([(300, 0.203)], mb=9, syncs=7, acc=0.89)   # 1.1% less accurate
    assert all("**not met**" in line for line in decentral.verdicts(data))
    for k in (0, 1, 2):
        runs[f"{decentral.DYNAMIC[0]}@{k}"] = _run([(300, 0.200)], mb=11, syncs=7)   # as good, 9.1x fewer bytes
    assert all("**not met**" in line for line in decentral.verdicts(data))
    for k in (0, 1, 2):
        runs[f"{decentral.DYNAMIC[0]}@{k}"] = _run([(300, 0.203)], mb=9, syncs=7)
    data["seeds"] = [0, 1, 2, 3]  # periodic averaging extended by a seed dynamic did not run: paired seeds only
    runs[f"{decentral.PERIODIC[0]}@3"] = runs[f"{decentral.POSTLOCAL4[0]}@3"] = _run([(300, 0.100)], mb=100)
    assert all("(the 3 seeds both ran)" in line and "loss +1.5%" in line for line in decentral.verdicts(data))
    data["scenarios"]["drift"] = {"runs": {f"{decentral.DYNAMIC[0]}@0": _run([(140, 0.3), (300, 0.2)])}, "targets": {}}
    assert decentral.scenario_seeds(data, "skew") == [0, 1, 2, 3] and decentral.scenario_seeds(data, "drift") == [0]
    decentral.render(data, tmp_path)
    text = (tmp_path / "decentral.md").read_text()
    assert "| dynamic (defaults) | 0.2030, 0.2030, 0.2030, - |" in text and (tmp_path / "decentral.png").exists()
    assert "Seeds skew 0, 1, 2, 3; drift 0," in text and "| dynamic (defaults) | 0.2000 |" in text  # drift: its seed


def test_slowlink_verdict_compares_time_to_target():
    data = {"seeds": [0], "scenarios": {"slowlink": {"targets": {"0": 0.5}, "runs": {}}}}
    runs = data["scenarios"]["slowlink"]["runs"]
    labels = [label for label, _ in decentral.SCENARIOS["slowlink"]["contenders"]]
    assert [label.startswith("gossip") for label in labels] == [True] * 4 + [False] * 3
    for i, label in enumerate(labels):   # gossip reaches 0.5 at 10 to 40 s, the others at 50, 60, 70 s
        runs[f"{label}@0"] = {**_run([(5, 0.9), (10 * (i + 1), 0.5)]),
                              "val_curve": [(5.0, 0.9, 5), (10.0 * (i + 1), 0.5, 10)]}
    lines = decentral.verdicts(data)   # each gossip sooner than DDP, post-local SGD, hivemind
    assert len(lines) == 4 and "gossip exp2 10 s" in lines[0] and all("**met**" in line for line in lines)
    runs[f"{labels[0]}@0"]["val_curve"] = [(5.0, 0.9, 5), (50.0, 0.6, 10)]   # never reaches the target
    assert "gossip exp2 never" in decentral.verdicts(data)[0] and "**not met**" in decentral.verdicts(data)[0]


def test_drift_final_run_is_judged_on_paired_per_seed_differences(tmp_path):
    data = {"seeds": [0, 1, 2], "commands": ["x"], "commits": ["abc"], "scenarios": {"drift_fine": {"runs": {}, "targets": {}}}}
    runs = data["scenarios"]["drift_fine"]["runs"]
    back = {0: (260, 255), 1: (240, 250), 2: (250, 250)}   # dynamic's recovery step, PyTorch's
    for k, (d, p) in back.items():
        runs[f"{decentral.DYNAMIC[0]}@{k}"] = _run([(145, 0.3), (150, 2.0), (d, 0.3)])
        runs[f"{decentral.POSTLOCAL4[0]}@{k}"] = _run([(145, 0.3), (150, 2.0), (p, 0.3)])
    (line,) = decentral.verdicts(data)
    assert "median over the 3 seeds both ran: 0: **met**" in line and "at step 250, periodic" in line
    runs[f"{decentral.DYNAMIC[0]}@2"] = _run([(145, 0.3), (150, 2.0), (600, 0.4)])   # never back: +inf
    (line,) = decentral.verdicts(data)
    assert "median over the 3 seeds both ran: 5: **not met**" in line
    decentral.render(data, tmp_path)
    assert "| dynamic (defaults) | 0.3000, 0.3000, 0.4000 |" in (tmp_path / "decentral.md").read_text()
