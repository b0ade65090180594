"""Where this process sits in the job, read from torchrun's environment (or a single process).

The same code runs under ``thinwire train`` (one process, no launcher), under the elastic agent that
``thinwire train --nproc N`` starts through ``torch.distributed.run``, and under a user's own
multi-node ``torchrun``: only the environment differs.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    world: int
    local_rank: int
    local_world: int
    restart_count: int
    launched: bool  # True under torchrun's agent (env:// rendezvous), False for a bare process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def read_env() -> DistEnv:
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    if not launched:
        return DistEnv(0, 1, 0, 1, 0, False)
    return DistEnv(
        rank=int(os.environ["RANK"]),
        world=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        launched=True,
    )


def device_for(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        check_gpus(env.local_world, "LOCAL_WORLD_SIZE")
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def check_gpus(workers: int, field: str = "--nproc") -> None:
    """NCCL runs one worker per GPU: more workers on a host than it has GPUs cannot start.

    Two NCCL ranks on one GPU fail inside NCCL ("Duplicate GPU detected") or hang; this says so
    before anything starts. On a machine without CUDA any count is fine (gloo on the CPU)."""
    if not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if workers > gpus:
        from thinwire.errors import ConfigError

        raise ConfigError(field, workers, f"at most {gpus}, the GPUs this host has (NCCL runs one worker per GPU)",
                          f"Pass --nproc {gpus}, or set CUDA_VISIBLE_DEVICES= (empty) to run {workers} workers on the "
                          "CPU with gloo.")


def init(env: DistEnv, device: torch.device, timeout_s: float = 300.0) -> None:
    """Start the process group: NCCL on CUDA, gloo on CPU; a private store for a bare process."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from thinwire.signals import stop_signals_end_process

    if env.launched and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        with stop_signals_end_process():  # a stop while it waits for the other ranks ends it at once
            dist.init_process_group(backend, store=_attempt_store(env, timeout), rank=env.rank, world_size=env.world,
                                    timeout=timeout)
    elif env.launched:
        with stop_signals_end_process():
            dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _attempt_store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's own store, under a prefix of this restart attempt.

    Workers share the elastic agent's TCPStore, and across restarts its keys survive: a restarted
    worker can read the dead workers' gloo addresses and fail with "connection refused". A prefix
    per attempt keeps each attempt's keys apart (the store and the rendezvous stay torchrun's).
    The prefix is the agent's restart count, which agrees between workers under one agent
    (``--nproc``). Agents on several nodes count restarts on their own (a restart caused by another
    node joining is not counted), so ``--cluster`` runs its agents with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a fresh store each round, no prefix needed. Do the same
    for a multi-node ``torchrun`` with ``--max-restarts``.
    """
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"/thinwire/attempt_{env.restart_count}", store)


#: set by ``thinwire cluster``'s launches: the emulated host's CPU share, which a process inside the
#: host's network namespace cannot read from its cgroup (``ip netns exec`` remounts /sys)
HOST_CPUS_ENV = "THINWIRE_HOST_CPUS"
#: set by ``thinwire cluster``'s launch that goes on around the ring after the switch's aggregator died: the
#: restarts the run took before this launch (torchelastic's count starts again from 0), for its summary
RESTARTS_BEFORE_ENV = "THINWIRE_RESTARTS_BEFORE"


def set_threads(env: DistEnv, threads: int | None) -> int:
    """``threads``, or the cores this process may use shared among the local workers (at least one)."""
    n = threads or max(1, int(available_cores() // env.local_world))
    torch.set_num_threads(n)
    return n


def available_cores(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float:
    """Cores this process may use: its CPU affinity, capped by a CPU quota, the emulated host's
    (:data:`HOST_CPUS_ENV`) or its cgroup's (``cpu.max``, or v1's ``cpu.cfs_quota_us``: what
    ``docker --cpus`` and Kubernetes' CPU limits set). PyTorch's default, ``os.cpu_count()``, ignores
    the quota: two threads in half a core of quota made charlm's step 26% slower than one
    (benchmarks/results/threads_quota.md: 139.9 against 110.9 ms, 3 seeds interleaved), as the
    threads' share of the quota is throttled in turn."""
    n = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    given = os.environ.get(HOST_CPUS_ENV)
    try:
        quota = float(given) if given else cgroup_cpu_quota(proc_cgroup, root)
    except ValueError:
        quota = None
    return min(n, quota) if quota and quota > 0 else n


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The tightest CPU quota (cores) on this process's cgroup path and its ancestors; None if none
    is set or the files cannot be read."""
    try:
        lines = open(proc_cgroup).read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: cpu.max is "QUOTA PERIOD" or "max PERIOD"
            files = [(f"{root}/{p}/cpu.max", None) for p in _ancestors(path)]
        elif "cpu" in controllers.split(","):  # v1
            base = f"{root}/{controllers}"
            files = [(f"{base}/{p}/cpu.cfs_quota_us", f"{base}/{p}/cpu.cfs_period_us") for p in _ancestors(path)]
        else:
            continue
        for quota_file, period_file in files:
            try:
                if period_file is None:
                    quota, period = open(quota_file).read().split()
                else:
                    quota, period = open(quota_file).read().strip(), open(period_file).read().strip()
            except (OSError, ValueError):
                continue
            if quota not in ("max", "-1") and float(period) > 0:
                limits.append(float(quota) / float(period))
    return min(limits) if limits else None


def _ancestors(path: str) -> list[str]:
    parts = [p for p in path.strip("/").split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]
