"""Hosts that leave and come back (issue 22): ``thinwire train --cluster SPEC --min-hosts N``.

The emulator test needs root (skipped elsewhere): a host is killed mid-run (``thinwire cluster
kill``: link down, its processes SIGKILLed), the others go on from the last checkpoint at the
smaller world size; it is restored and joins again; the run finishes all its steps and learns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli import ROOT, assert_refused, thinwire
from thinwire.cluster.emulator import EmulatedCluster
from thinwire.cluster.spec import load_cluster_spec


def _spec(tmp_path: Path, hosts: int = 3) -> Path:
    spec = tmp_path / "spec.yaml"
    names = "".join(f"  - {{name: h{i}}}\n" for i in range(hosts))
    spec.write_text(f"name: te{os.getpid()}\ndefaults: {{bandwidth: 1gbit, cpu: 0.6}}\nhosts:\n{names}")
    return spec


@pytest.mark.parametrize("extra, pattern", [
    (["--min-hosts", "2"], r"max_restarts: must be at least 1 with min_hosts, got 0.*Every host that leaves"),
    (["--min-hosts", "0", "--max-restarts", "1"], r"min_hosts: must be an integer in \[1, 4096\], got 0"),
    (["--min-hosts", "2", "--max-restarts", "1", "--batch-size", "64"],
     r"batch_size: must be divisible by every number of hosts the run may have \(2 to 3 with min_hosts 2\).*multiple of 6"),
])
def test_bad_elastic_input_is_refused_before_launch(tmp_path, extra, pattern):
    proc = thinwire("train", "--workload", "digits", "--cluster", str(_spec(tmp_path)), *extra,
                    "--out", str(tmp_path / "run"))
    assert_refused(proc, pattern)
    assert not (tmp_path / "run").exists()


def test_min_hosts_needs_a_cluster(tmp_path):
    proc = thinwire("train", "--workload", "digits", "--min-hosts", "1", "--max-restarts", "1",
                    "--out", str(tmp_path / "run"))
    assert_refused(proc, r"min_hosts: must be used with --cluster SPEC.*--nnodes MIN:MAX")


def _events(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"event"' in line]


def _wait(pred, proc: subprocess.Popen, what: str, limit: float = 180) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
    raise AssertionError(f"{what}: not within {limit} s (exit {proc.poll()}): {err[-3000:]}")


def _max_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines() if line.strip()), default=0)


@pytest.mark.root
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for network namespaces and cgroups")
@pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="needs iproute2 (ip, tc)")
def test_a_killed_host_leaves_the_rest_go_on_and_it_joins_again_when_restored(tmp_path):
    spec = _spec(tmp_path)
    c = EmulatedCluster(load_cluster_spec(spec))
    c.up()
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "thinwire", "train", "--cluster", str(spec), "--workload", "digits",
                             "--steps", "240", "--batch-size", "48", "--checkpoint-every", "20", "--eval-every", "120",
                             "--min-hosts", "2", "--max-restarts", "3", "--set", "timeout_s=20", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _wait(lambda: _max_step(out) >= 45, proc, "step 45 with 3 hosts")
        c.kill_host("h2")
        assert c.killed_hosts() == {"h2"} and not c.cgroups.pids("h2")
        _wait(lambda: any(e["event"] == "restart" and e["world_size"] == 2 for e in _events(out)), proc,
              "a restart with 2 hosts")
        two = next(e for e in _events(out) if e["event"] == "restart" and e["world_size"] == 2)
        assert two["checkpoint_world_size"] == 3 and two["step"] >= 40  # at most the steps since the checkpoint lost
        _wait(lambda: _max_step(out) >= two["step"] + 20, proc, "20 steps with 2 hosts")
        c.restore_host("h2")
        _wait(lambda: any(e["event"] == "restart" and e["world_size"] == 3 and e["step"] > two["step"]
                          for e in _events(out)), proc, "h2 back: a restart with 3 hosts")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        c.down()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 240 and summary["world_size"] == 3 and summary["val_accuracy"] > 0.9
