"""Default torch threads respect a CPU quota: the emulated host's, or the cgroup's (v1 and v2), as
``docker --cpus`` sets it; without one, the CPU affinity."""

from __future__ import annotations

import os

import pytest
import torch

from thinwire.errors import ConfigError
from thinwire.train.distenv import HOST_CPUS_ENV, available_cores, cgroup_cpu_quota

CORES = float(len(os.sched_getaffinity(0)))


def _v2(tmp_path, quotas: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cg"
    for path, value in quotas.items():
        d = root / path
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    return str(proc), str(root)


def test_cgroup_v2_quota_is_the_tightest_on_the_path(tmp_path, monkeypatch):
    monkeypatch.delenv(HOST_CPUS_ENV, raising=False)
    proc, root = _v2(tmp_path, {"": "max 100000", "a": "150000 100000", "a/b": "max 100000"})
    assert cgroup_cpu_quota(proc, root) == 1.5
    assert available_cores(proc, root) == min(CORES, 1.5)
    proc, root = _v2(tmp_path / "none", {"": "max 100000", "a/b": "max 100000"})
    assert cgroup_cpu_quota(proc, root) is None and available_cores(proc, root) == CORES


def test_cgroup_v1_quota(tmp_path, monkeypatch):
    monkeypatch.delenv(HOST_CPUS_ENV, raising=False)
    d = tmp_path / "cg" / "cpu,cpuacct" / "job"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("5000\n")
    (d / "cpu.cfs_period_us").write_text("10000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/job\n2:cpu,cpuacct:/job\n")
    assert cgroup_cpu_quota(str(proc), str(tmp_path / "cg")) == 0.5


def test_the_emulated_hosts_share_wins_and_nothing_readable_means_the_affinity(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_CPUS_ENV, "0.25")
    assert available_cores(str(tmp_path / "missing"), str(tmp_path)) == min(CORES, 0.25)
    monkeypatch.setenv(HOST_CPUS_ENV, "not-a-number")
    assert available_cores(str(tmp_path / "missing"), str(tmp_path)) == CORES
    monkeypatch.delenv(HOST_CPUS_ENV)
    assert available_cores(str(tmp_path / "missing"), str(tmp_path)) == CORES


@pytest.mark.parametrize("cores, workers, threads", [(0.5, 1, 1), (2.0, 1, 2), (2.0, 4, 1), (8.0, 2, 4)])
def test_set_threads_divides_the_cores_among_local_workers(monkeypatch, cores, workers, threads):
    import torch

    from thinwire.train import distenv

    monkeypatch.setattr(distenv, "available_cores", lambda: cores)
    env = distenv.DistEnv(rank=0, world=workers, local_rank=0, local_world=workers, launched=True, restart_count=0)
    before = torch.get_num_threads()
    try:
        assert distenv.set_threads(env, None) == threads and torch.get_num_threads() == threads
        assert distenv.set_threads(env, 3) == 3
    finally:
        torch.set_num_threads(before)


def test_more_workers_than_gpus_is_refused_before_anything_starts(tmp_path, monkeypatch, capsys):
    """NCCL runs one worker per GPU: ``--nproc 2`` on a one-GPU host is refused, naming the fix."""
    from thinwire.cli.main import main
    from thinwire.train import distenv

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    out = tmp_path / "run"
    assert main(["train", "--workload", "digits", "--steps", "2", "--nproc", "2", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "--nproc: must be at most 1, the GPUs this host has" in err and "CUDA_VISIBLE_DEVICES=" in err
    assert not out.exists()
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE: must be at most 1"):
        distenv.device_for(distenv.DistEnv(rank=1, world=2, local_rank=1, local_world=2, restart_count=0, launched=True))
    distenv.check_gpus(1)  # one worker per GPU is fine
