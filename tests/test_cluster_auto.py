"""``--compression auto`` on emulated links: a light codec (none or bf16) on a fast link, a strong one on a
slow link. Needs root; skipped elsewhere.

The model is charlm at its defaults (446k parameters, 1.8 MB of fp32 gradients per step) with 16
sequences per rank: at 10 Gbit/s its all-reduce takes a few ms against about 130 ms of compute (a
fast link: compression could save a few percent at most), at 20 Mbit/s about 0.7 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.test_cli import ROOT
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec

pytestmark = [
    pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
]

LIGHT = {"none", "bf16"}


def _auto_choices(tmp_path, rate: str) -> list[dict]:
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: ta{os.getpid()}\nsubnet: 10.229.0.0/24\ndefaults: {{bandwidth: {rate}, cpu: 1.0}}\n"
                    "hosts:\n  - {name: h0}\n  - {name: h1}\n")
    cluster = EmulatedCluster(load_cluster_spec(spec))
    cluster.up()
    try:
        out = tmp_path / "run"
        args = [sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "charlm",
                "--compression", "auto", "--steps", "14", "--batch-size", "32", "--threads", "1",
                "--eval-every", "100", "--checkpoint-every", "100", "--out", str(out)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-2000:]
    finally:
        cluster.down()
    decisions = json.loads((out / "summary.json").read_text())["auto_decisions"]
    assert decisions and decisions[0]["reason"] == "warm-up done"
    return decisions


def test_auto_picks_a_light_codec_on_a_fast_link(tmp_path):
    decisions = _auto_choices(tmp_path, "10gbit")
    for d in decisions:
        assert set(d["choices"].values()) <= LIGHT, d


def test_auto_picks_a_strong_codec_on_a_slow_link(tmp_path):
    decisions = _auto_choices(tmp_path, "20mbit")
    assert not set(decisions[0]["choices"].values()) & LIGHT, decisions[0]
    assert decisions[0]["predicted_step_s"] < 0.5 * decisions[0]["uncompressed_step_s"]
