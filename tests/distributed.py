"""Run a function on W CPU processes joined by gloo over loopback (a test harness, not a launcher)."""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, queue) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        buf = io.BytesIO()  # plain bytes: tensors shared by handle would die with this process
        torch.save(fn(rank, world, *args), buf)
        queue.put((rank, buf.getvalue(), None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, None, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    """Results of ``fn(rank, world, *args)`` on every rank, in rank order; raises on any failure."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, value, err = queue.get(timeout=timeout)
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
