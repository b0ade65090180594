"""benchmarks/gpu_check.py, the GPU path's one prepared script: its CPU parts run here (the same
code a GPU runs, on the CPU and gloo), and it refuses to pass CPU numbers off as a GPU's."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from tests.test_cli import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script runs for real")
def test_refuses_without_cuda_unless_asked(capsys):
    assert gpu_check.main([]) == 2
    assert "--cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_cpu_parts_run_and_report_every_part(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu", "--quick",
                           "--results", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert res["environment"]["device"] == "cpu"
    assert [r["precision"] for r in res["parity"]] == ["fp32", "bf16", "int8"]
    for r in res["parity"]:
        assert r["device"] == "cpu" and r["backend"] == "gloo" and r["counts"].get("int8", 0) > 0
        assert abs(r["loss_vs_fp32"]) < 0.05  # 10 steps: the precisions cannot have drifted apart yet
    ic = res["int8_against_cpu"]
    assert all(e["equal"] for e in ic["matmul_exact"]) and set(ic["linear_rel_diff"]) == {"pow2", "rowwise"}
    assert [(r["sync"], r["compression"]) for r in res["modes"]] == list(gpu_check.QUICK_MODES)
    assert set(gpu_check.QUICK_MODES) <= set(gpu_check.MODES)
    for r in res["modes"]:
        assert r["device"] == "cpu" and r["backend"] == "gloo" and math.isfinite(r["val_loss"])
        if r["sync"] == "allreduce" and r["compression"] != "auto":  # every step sends through the named codec
            assert r["counts"].get(r["compression"], 0) > 0, r
    assert res["too_many_workers"]["exit"] == 0  # no CUDA here: gloo on the CPU takes any count
    assert {r["precision"] for r in res["speed"]} == {"fp32", "bf16", "int8"}
    assert next(r for r in res["speed"] if r["precision"] == "fp32")["x_fp32"] == 1.0
    codecs = {r["codec"].split(":")[0] for r in res["codecs"]}
    assert {"none", "int8", "bfp", "topk", "powersgd"} <= codecs
    assert next(r for r in res["codecs"] if r["codec"] == "none")["rel_error"] == 0.0
    md = (tmp_path / "gpu_check_cpu.md").read_text()
    assert "on cpu" in md and "| int8 |" in md
