"""The offload engine (issue 24): a host's communication work on a processor of its own (spec ``nic:``),
or on a core of its own (``offload=core:N``, real machines).

On the emulator (root; skipped elsewhere) the launcher moves each worker's engine thread and gloo's
threads into the host's engine cgroup; the run reports how many of its threads ended there, and
offloading changes no numerics: the same seed gives the same loss as the inline run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.test_cli import ROOT, assert_refused, thinwire
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec


def _train(spec: Path | None, out: Path, offload: str) -> dict:
    where = ["--cluster", str(spec)] if spec else ["--nproc", "2"]
    proc = subprocess.run([sys.executable, "-m", "thinwire", "train", *where, "--workload", "digits",
                           "--steps", "40", "--batch-size", "48", "--eval-every", "40", "--compression", "int8",
                           "--set", f"offload={offload}", "--out", str(out)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups")
@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)")
def test_the_engine_runs_the_communication_threads_and_changes_no_numerics(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"name: to{os.getpid()}\ndefaults: {{bandwidth: 1gbit, cpu: 0.5, nic: {{cpu: 0.25}}}}\n"
                    "hosts: [{name: h0}, {name: h1}]\n")
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    try:
        nic = Path(c.cgroups.nic_tasks_file("h0")).parent
        assert (nic / "cpu.cfs_quota_us").read_text().strip() == "2500"  # 0.25 core of a 10 ms period
        assert [s.nic_cpu for s in c.status()] == [0.25, 0.25]
        on = _train(spec, tmp_path / "on", "auto")
        seen: set[str] = set()  # what the engines' cgroups held while the inline run trained
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.05):
                for h in ("h0", "h1"):
                    seen.update(Path(c.cgroups.nic_tasks_file(h)).read_text().split())

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            off = _train(spec, tmp_path / "off", "off")
        finally:
            done.set()
            watcher.join()
    finally:
        c.down()
    # the engine thread, gloo's I/O loop and its two collective workers, counted before the engine stops
    assert on["offload"]["engine_cpu"] == 0.25 and on["offload"]["threads_on_engine"] >= 4, on["offload"]
    assert "offload" not in off and not seen, seen  # offload=off keeps everything inline, on the host's own CPU
    assert on["val_loss"] == off["val_loss"] and on["val_accuracy"] > 0.8


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores: one for compute, one for the engine")
def test_a_pinned_core_runs_the_communication_threads_and_changes_no_numerics(tmp_path):
    core = max(os.sched_getaffinity(0))
    on = _train(None, tmp_path / "on", f"core:{core}")
    off = _train(None, tmp_path / "off", "off")
    assert on["offload"]["core"] == core and on["offload"]["threads_on_engine"] >= 3, on["offload"]
    assert on["val_loss"] == off["val_loss"]


@pytest.mark.parametrize("value, pattern", [
    ("core:4096", r"offload: must name one of the cores this worker may use \([0-9, ]+\) and leave at least one other"),
    ("cores", r"offload: must be auto, off or core:N .*got 'cores'"),
])
def test_a_bad_offload_is_refused_before_launch(tmp_path, value, pattern):
    proc = thinwire("train", "--workload", "digits", "--set", f"offload={value}", "--out", str(tmp_path / "run"))
    assert_refused(proc, pattern)
    assert not (tmp_path / "run").exists()
