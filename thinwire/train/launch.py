"""Starting workers: in this process, or N local workers through torchrun's elastic agent.

``thinwire train`` never spawns workers itself. With ``--nproc N`` or ``--max-restarts K`` it hands
``python -m thinwire.train.worker CONFIG`` to ``torch.distributed.launcher.api.elastic_launch`` (the
machinery behind ``torchrun``): c10d rendezvous on loopback, one agent watching N workers, and, when
a worker dies, all of them restarted (up to K times) so they resume from the last checkpoint.
Under a user's own ``torchrun`` the workers already exist, and ``thinwire train`` runs the loop
directly.
"""

from __future__ import annotations

import logging
import socket
import sys
import uuid
from pathlib import Path

from thinwire.errors import ThinwireError
from thinwire.train.config import TrainConfig


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(cfg: TrainConfig, config_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    lc = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc, run_id=f"thinwire-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=cfg.max_restarts,
        monitor_interval=0.5,
    )
    try:
        elastic_launch(lc, sys.executable)("-m", "thinwire.train.worker", str(config_path))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        detail = failure.message
        if isinstance(detail, dict):
            detail = detail.get("message", str(detail))
        raise ThinwireError(
            f"worker {rank} failed (exit code {failure.exitcode}) after {cfg.max_restarts} allowed restart(s): "
            f"{detail.strip()[:800] or 'see its output above'}"
        ) from None
