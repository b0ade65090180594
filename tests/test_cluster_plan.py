"""``thinwire plan`` then ``thinwire train --plan`` on the emulated cluster it was made for (root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.test_cli import ROOT, thinwire
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec

pytestmark = [
    pytest.mark.root, pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)"),
]


def test_plan_then_train_with_it(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: tp{os.getpid()}\ndefaults: {{bandwidth: 50mbit}}\nhosts:\n"
                    "  - {name: fast0, cpu: 0.8}\n  - {name: fast1, cpu: 0.8}\n  - {name: slow, cpu: 0.2}\n")
    plan = tmp_path / "plan.yaml"
    made = thinwire("plan", "--cluster", str(spec), "--workload", "digits", "--batch-size", "60", "--out", str(plan))
    assert made.returncode == 0, made.stderr[-2000:]
    chosen = yaml.safe_load(plan.read_text())["chosen"]
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    try:
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--plan", str(plan),
                               "--workload", "digits", "--steps", "40", "--eval-every", "40", "--threads", "1",
                               "--out", str(out)], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        c.down()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == len(chosen["hosts"])
    assert summary["samples"] == 40 * 60
    assert summary["compression"].startswith("plan[")
    wrong = thinwire("train", "--cluster", str(spec), "--plan", str(plan), "--workload", "charlm", "--out", str(tmp_path / "x"))
    assert wrong.returncode == 2 and "was made for another workload" in wrong.stderr
