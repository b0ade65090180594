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
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init(env: DistEnv, device: torch.device, timeout_s: float = 300.0) -> None:
    """Start the process group: NCCL on CUDA, gloo on CPU; a private store for a bare process."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if env.launched and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_attempt_store(env, timeout), rank=env.rank, world_size=env.world,
                                timeout=timeout)
    elif env.launched:
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


def set_threads(env: DistEnv, threads: int | None) -> int:
    n = threads or max(1, (os.cpu_count() or 1) // env.local_world)
    torch.set_num_threads(n)
    return n
