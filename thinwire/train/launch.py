"""Starting workers: in this process, or N local workers through torchrun's elastic agent.

``thinwire train`` never spawns workers itself. With ``--nproc N`` or ``--max-restarts K`` it hands
``python -m thinwire.train.worker CONFIG`` to ``torch.distributed.launcher.api.elastic_launch`` (the
machinery behind ``torchrun``): c10d rendezvous on loopback, one agent watching N workers, and, when
a worker dies, all of them restarted (up to K times) so they resume from the last checkpoint.
Under a user's own ``torchrun`` the workers already exist, and ``thinwire train`` runs the loop
directly.

Nothing listens beyond loopback. A ``TCPStore`` server binds to every interface whatever host it is
given (``TCPStore("127.0.0.1", ...)`` listens on ``*``), and the agent runs two: the c10d rendezvous
store and the store it shares with the workers. So the agent uses the rendezvous backend
``thinwire-loopback``: torch's own c10d rendezvous, with both stores handed a socket already bound to
127.0.0.1 (``master_listen_fd``). The workers' gloo listeners follow ``GLOO_SOCKET_IFNAME``, set to
the loopback interface.

Stop signals (Ctrl-C, SIGTERM, SIGHUP) reach the agent, which forwards them to the workers and
raises torchelastic's ``SignalException``; :func:`launch_local` turns that into
:class:`~thinwire.signals.Stopped`, which the CLI reports in one line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from thinwire.errors import LOST_PEER_EXIT, ThinwireError
from thinwire.signals import Stopped, handlers_restored
from thinwire.train.config import TrainConfig

LOOPBACK = "127.0.0.1"
RDZV_BACKEND = "thinwire-loopback"
# torchelastic's warnings while it forwards a stop signal to the workers: the CLI says it in one line
# torch's own lines about stopping workers, and its "failed (exitcode: 1) local_rank: 0 (pid: ...) of binary: ..."
# (thinwire's error names the worker that failed first, and why)
_SHUTDOWN_NOISE = ("Received %s death signal", "Sending process %s closing signal", "Closing process %s via signal",
                   "Got termination signal", "failed (exitcode: %s) local_rank: %s")


def loopback_store(port: int = 0, **kwargs):
    """A ``TCPStore`` server listening on 127.0.0.1:``port`` only (0: any free port).

    ``TCPStore`` would bind its server to every interface; given ``master_listen_fd`` it serves on
    that socket instead, and owns it from then on."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, port))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                         wait_for_workers=False, master_listen_fd=sock.fileno(), **kwargs)
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def _create_loopback_handler(params):
    """torch's c10d rendezvous (``create_handler``), its stores bound to loopback."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class LoopbackHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port):  # the store shared with the workers
            return loopback_store(master_port)

        def get_backend(self) -> str:  # the registry checks that the handler is the backend it asked for
            return RDZV_BACKEND

    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = loopback_store(port)
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    handler.__class__ = LoopbackHandler  # create_handler parses the timeouts; only the store server differs
    return handler


def _register_backend() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(RDZV_BACKEND, _create_loopback_handler)


def loopback_interface() -> str | None:
    """Name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS), None if neither exists."""
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    """Set environment variables (inherited by the workers) for the block; restore them after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _DropShutdownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_SHUTDOWN_NOISE)


def _quiet_elastic_logs() -> None:
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropShutdownNoise) for f in logger.filters):
            logger.addFilter(_DropShutdownNoise())


def launch_local(cfg: TrainConfig, config_path: Path, module: str = "thinwire.train.worker") -> None:
    """Run ``cfg.nproc`` workers (``python -m MODULE CONFIG``) under torchrun's elastic agent in this
    process, all on loopback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_elastic_logs()
    _register_backend()
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=f"thinwire-{uuid.uuid4().hex[:8]}",
        rdzv_backend=RDZV_BACKEND, rdzv_endpoint=f"{LOOPBACK}:0", local_addr=LOOPBACK,
        max_restarts=cfg.max_restarts,  # monitor_interval: torchrun's (0.1 s; 0.5 s kept every run up to 0.5 s longer)
    )
    try:
        with handlers_restored(), _env(GLOO_SOCKET_IFNAME=loopback_interface()):
            elastic_launch(lc, sys.executable)("-m", module, str(config_path))
    except SignalException as e:
        raise Stopped(int(e.sigval)) from None
    except ChildFailedError as e:
        raise _worker_failed(e, cfg.max_restarts, cfg.out) from None


def _recorded(failure) -> str:
    """The text a failed worker's error file records (torch's ``@record``)."""
    detail = failure.message
    return str(detail.get("message", detail)) if isinstance(detail, dict) else str(detail)


def _raised(failure) -> str:
    """The exception a failed worker's error file records, or ''."""
    detail = _recorded(failure).removeprefix("ThinwireError: ")  # a worker's own one-paragraph error
    return "" if detail.startswith(("To enable traceback", "Signal ")) else detail.strip()[:800]


def _own_error(failure) -> bool:
    """Whether the worker left with thinwire's own error, which it printed itself (``thinwire: error: ...``)
    before it recorded it."""
    return _recorded(failure).startswith("ThinwireError: ")


STOPPED_EXITS = tuple(128 + s for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM))


def _worker_failed(e, max_restarts: int, out: str | None = None) -> ThinwireError:
    """The job's failure, named by the worker that caused it. Once one worker dies the others lose their
    connections to it (they exit with ``LOST_PEER_EXIT``) or are stopped by the agent (SIGTERM), often before
    the agent has noticed the first: the earliest failure is then not the cause."""
    failures = dict(e.failures)
    # a worker the agent stopped while it was still leaving after its own exception (its error file says so)
    # is a cause too, not collateral
    collateral = {r for r, f in failures.items()
                  if f.exitcode == LOST_PEER_EXIT or (f.exitcode == -signal.SIGTERM and not _raised(f))}
    causes = [r for r in failures if r not in collateral]
    rank = min(causes, key=lambda r: failures[r].timestamp) if causes else e.get_first_failure()[0]
    failure = failures[rank]
    detail = _raised(failure)
    lost = sorted(r for r, f in failures.items() if f.exitcode == LOST_PEER_EXIT and r != rank)
    # a worker that caught a stop signal itself (sent to it, not by the agent) leaves with 128 + the signal
    caught = failure.exitcode - 128 if failure.exitcode in STOPPED_EXITS and not detail else None
    if caught:
        what = f"worker {rank} was stopped by {signal.Signals(caught).name}"
    elif failure.exitcode < 0 and not detail:
        what = f"worker {rank} was killed by {failure.signal_name()}"
    elif failure.exitcode == LOST_PEER_EXIT:
        what = (f"the workers lost their connections to each other (worker {rank} first; a network fault, or a "
                f"worker that hung past the collective timeout)")
    elif failure.exitcode < 0:  # raised, then stopped by the agent before it had left
        what = f"worker {rank} failed (stopped by {failure.signal_name()} while leaving)"
    else:
        what = f"worker {rank} failed (exit code {failure.exitcode})"
    others = (f"; worker{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} then lost "
              f"{'their' if len(lost) > 1 else 'its'} connection to it") if lost and causes else ""
    if (failure.exitcode < 0 or caught) and not detail:  # a signal leaves no message: say what to do instead
        again = f"`thinwire train --resume {out}`" if out else "--resume"
        return ThinwireError(f"{what} after {max_restarts} allowed restart(s){others}, and the job stopped. Go on from "
                             f"its last checkpoint with {again}; --max-restarts N restarts by itself.")
    if _own_error(failure):  # printed by the worker already: once is enough
        return ThinwireError(f"{what} after {max_restarts} allowed restart(s){others}, with the error above.")
    return ThinwireError(f"{what} after {max_restarts} allowed restart(s){others}: {detail or 'see its output above'}")
