"""Stop signals as exceptions, so every run and every cluster ends through its ``finally`` blocks.

Python turns SIGINT (Ctrl-C) into :class:`KeyboardInterrupt` but lets SIGTERM and SIGHUP kill the
process on the spot: no cleanup runs, so namespaces, qdiscs, cgroups and worker processes would be
left behind. :func:`stop_signals_raise` makes all three raise :class:`Stopped` (a ``BaseException``,
like ``KeyboardInterrupt``, so ``except Exception`` does not swallow it); the CLI prints one line and
exits ``128 + signum``, the shell convention (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP).

While cleanup itself runs, :func:`deferred` holds the signals back, so a second Ctrl-C cannot
interrupt a half-done teardown; the first one that arrived is raised when the block ends::

    with stop_signals_raise():
        try:
            build()
        except BaseException:
            with deferred():
                teardown()
            raise
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """The process received a stop signal (SIGINT, SIGTERM or SIGHUP)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def leave_quietly_on_stop() -> None:
    """Until a ``stop_signals_raise`` block takes over, a stop signal ends this process at once with ``128 +
    signum`` and no output: for a worker that is still importing torch (a Ctrl-C then interrupts an import,
    whose traceback tells the user nothing) and has written nothing yet. Call it before the heavy imports."""
    import os

    for s in STOP_SIGNALS:
        signal.signal(s, lambda signum, frame: os._exit(128 + signum))


def _raise(signum: int, frame) -> None:
    raise Stopped(signum)


def signum_of(exc: BaseException | None) -> int | None:
    """The stop signal behind ``exc`` (Stopped, KeyboardInterrupt, torchelastic's SignalException).

    Follows the chain of exceptions: a signal inside ``torch.save`` surfaces as the RuntimeError its
    zip writer raises while unwinding, with the Stopped as its context."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, Stopped):
            return exc.signum
        if isinstance(exc, KeyboardInterrupt):
            return signal.SIGINT
        sigval = getattr(exc, "sigval", None)  # torch.distributed.elastic.multiprocessing.api.SignalException
        if sigval is not None:
            return int(sigval)
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def handlers_restored(signals=STOP_SIGNALS) -> Iterator[None]:
    """Put back this process's handlers for ``signals`` after the block (torchelastic replaces them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in signals}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def stop_signals_raise() -> Iterator[None]:
    """Inside the block, SIGINT, SIGTERM and SIGHUP raise :class:`Stopped`. No-op off the main thread."""
    with handlers_restored():
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, _raise)
        yield


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold stop signals back during the block (cleanup); raise the first one after it, if any."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    with handlers_restored():
        for s in STOP_SIGNALS:
            signal.signal(s, lambda signum, frame: received.append(signum))
        yield
    if received:
        raise Stopped(received[0])


ORPHAN_GRACE_S = 10.0  # after its SIGTERM, how long an orphaned worker may take to leave before it is ended


def stop_when_orphaned(interval: float = 1.0) -> threading.Thread:
    """A worker whose agent died (``kill -9`` of ``thinwire train`` or of the user's torchrun: it is re-parented)
    stops as if the agent had stopped it: a SIGTERM to itself, so it leaves as a stopped worker does; if it
    has not left ``ORPHAN_GRACE_S`` later (blocked in a collective with a peer that left), it exits at once.
    Checkpoints are written atomically: it loses at most the steps since the last one. Otherwise it would
    train on unwatched, writing into a run folder whose lock died with the agent."""
    import os
    import time

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(ORPHAN_GRACE_S)
        os._exit(128 + signal.SIGTERM)

    t = threading.Thread(target=watch, name="thinwire-orphan-watch", daemon=True)
    t.start()
    return t


@contextlib.contextmanager
def stop_signals_end_process() -> Iterator[None]:
    """Inside the block a stop signal ends the process at once, as the OS's default action does: for a wait in C++
    that keeps Python's handlers from running (a rank in ``init_process_group`` waiting for a rank 0 that refused
    to start: torchrun's SIGTERM then went unheard for its 30 s grace). Nothing is written before the process
    group exists, so nothing is lost. No-op off the main thread."""
    with handlers_restored():
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, signal.SIG_DFL)
        yield
