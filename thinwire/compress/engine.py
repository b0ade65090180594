"""One communication thread per process, so every rank issues its collectives in the same order.

A compressed bucket needs several steps, some of them collectives (PowerSGD: all-reduce P,
orthogonalize, all-reduce Q). PyTorch's PowerSGD hook chains them with ``Future.then`` callbacks,
which run on whichever thread completes the previous collective; with more than one bucket the
collectives of different buckets then interleave differently on different ranks, and gloo aborts
with a size mismatch. Here each bucket's whole job runs, in submission order, on a single thread.
DDP hands buckets to the hook in the same order on every rank, so every rank issues the same
sequence of collectives, while the main thread goes on with backward (communication still
overlaps computation).

:meth:`CommThread.idle` says whether every job submitted so far has returned (so has issued all its
collectives): then the submitting thread may issue a collective itself without changing the order,
which is how the hook sends a bucket that needs only all-reduces (see
:meth:`thinwire.compress.hook.CommState._send`).

**Offload** (a host with an engine of its own, cluster spec ``nic:``): every bucket's whole job runs
on this thread (none inline on DDP's). The thread names itself :data:`ENGINE_THREAD` so the emulator
can move it and gloo's threads (its I/O loop and collective workers, which copy, reduce and send;
:data:`OFFLOADED_THREADS`) into the engine's cgroup: the codec and the collectives then run on the
engine's CPU, off the host's compute quota.
"""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Callable

import torch

from thinwire.errors import ThinwireError

ENGINE_THREAD = "tw-engine"  # this thread's OS name
# what runs on an offload engine: this thread, and gloo's TCP I/O loop and collective workers (torch's names)
OFFLOADED_THREADS = (ENGINE_THREAD, "gloo_tcp_loop", "pt_gloo_runloop")


class EngineFuture(torch.futures.Future):
    """A job's future. A failed job stores its exception as the future's value (``Future.set_exception``),
    which Python's ``wait()`` raises again but DDP's C++ reducer reads as a result ("Unable to cast ... to
    Tensor"): hand DDP :func:`for_ddp` of it."""


def for_ddp(fut: torch.futures.Future) -> torch.futures.Future:
    """``fut`` as DDP's reducer should get it: a failed job as an error DDP raises with the job's message."""
    return fut.then(_value) if isinstance(fut, EngineFuture) else fut


def _value(fut: torch.futures.Future):
    return fut.value()  # raises a failed job's exception, inside a callback: the chained future fails with it


class CommThread:
    def __init__(self, name: str = "thinwire-comm") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._submitted = 0  # written by the submitting thread only
        self._returned = 0   # written by this thread only
        self.closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args) -> torch.futures.Future:
        """Run ``fn(*args)`` after every job submitted before it; its result completes the future."""
        self.check_open()  # else nothing would ever run it: the caller (DDP's reducer) would wait forever
        fut = EngineFuture()
        self._submitted += 1
        self._jobs.put((fut, fn, args))
        return fut

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("thinwire: this model's thinwire state was closed (close()), so it can no longer "
                               "average gradients; close it after the last backward and step, or build a new DDP "
                               "model and attach thinwire to it")

    def idle(self) -> bool:
        """Every submitted job has returned. Call it from the (single) submitting thread."""
        return self._returned == self._submitted

    def close(self) -> None:
        self.closed = True
        self._jobs.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        name_this_thread(ENGINE_THREAD)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fut, fn, args = item
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting DDP reducer
                self._returned += 1
                fut.set_exception(e)
            else:
                self._returned += 1
                fut.set_result(result)



def name_this_thread(name: str) -> None:
    """Give the calling thread an OS name (``/proc/self/task/TID/comm``; Python sets none), which is how
    the emulator finds the threads to move onto a host's offload engine. Best effort, Linux only."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _threads() -> list[tuple[int, str]]:
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            out.append((int(task.name), (task / "comm").read_text().strip()))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def check_core(core: int) -> None:
    """Refuse ``offload=core:N`` unless N is a core this process may use and another is left for compute."""
    usable = sorted(os.sched_getaffinity(0))
    if core not in usable or len(usable) < 2:
        raise ThinwireError(
            f"offload: must name one of the cores this worker may use ({', '.join(map(str, usable))}) and leave "
            f"at least one other for compute, got 'core:{core}'. "
            + ("Give the worker more cores, or use offload=auto." if len(usable) < 2 else f"Use core:{usable[-1]}."))


def pin_to_core(core: int) -> int:
    """An engine as a pinned core (real machines): this process's communication threads
    (:data:`OFFLOADED_THREADS`) run on ``core`` only, every other thread on the other cores it may use.
    Returns how many communication threads are pinned. Call again for threads started later."""
    allowed = os.sched_getaffinity(0) | {core}
    pinned = 0
    for tid, name in _threads():
        try:
            if name in OFFLOADED_THREADS:
                os.sched_setaffinity(tid, {core})
                pinned += 1
            else:
                os.sched_setaffinity(tid, allowed - {core})
        except (ProcessLookupError, OSError):
            continue
    return pinned


def threads_on_core(core: int) -> int:
    """How many of this process's communication threads may run on ``core`` only (what the summary reports)."""
    count = 0
    for tid, name in _threads():
        try:
            count += name in OFFLOADED_THREADS and os.sched_getaffinity(tid) == {core}
        except OSError:
            continue
    return count


def threads_on_engine(suffix: str = ".nic") -> int:
    """How many of this process's threads are in an offload engine's cgroup now (its name ends in
    ``suffix``; see :mod:`thinwire.cluster.cgroup`): what the summary reports."""
    count = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            lines = (task / "cgroup").read_text().splitlines()
        except OSError:
            continue
        count += any(line.split(":", 2)[2].rstrip("/").endswith(suffix) for line in lines if line.count(":") >= 2)
    return count
