"""Default torch threads respect a CPU quota: the emulated host's, or the cgroup's (v1 and v2), as
``docker --cpus`` sets it; without one, the CPU affinity."""

from __future__ import annotations

import os

import pytest

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
