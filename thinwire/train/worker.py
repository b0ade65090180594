"""Entry point of one worker process: ``python -m thinwire.train.worker RESOLVED_CONFIG.yaml``.

The agent started by :mod:`thinwire.train.launch` runs this in every worker; the config is the one
``thinwire train`` resolved and saved in the run folder, so all workers train the same thing.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # a stop signal while torch loads: out quietly (the launcher says it once)
    from thinwire.signals import leave_quietly_on_stop

    leave_quietly_on_stop()

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record  # noqa: E402

from thinwire.config import from_dict, load_yaml  # noqa: E402
from thinwire.errors import LOST_PEER_EXIT, LOST_PEER_SAYS, ThinwireError, lost_peer  # noqa: E402
from thinwire.signals import signum_of, stop_signals_raise, stop_when_orphaned  # noqa: E402
from thinwire.train.config import TrainConfig  # noqa: E402


@record
def main(argv: list[str]) -> int:
    from thinwire.train.loop import train

    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING, format=f"thinwire[{rank}]: %(message)s")
    path = Path(argv[0])
    cfg = from_dict(TrainConfig, load_yaml(path), where="")
    stop_when_orphaned()  # its agent killed: out, not on training into the run folder unwatched
    try:
        with stop_signals_raise():
            train(cfg, Path(cfg.out))
    except ThinwireError as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        # in the agent's error file, so the job's error names this worker even when a peer that lost it exits
        # first and the agent stops this one (SIGTERM) before it has left; then out at once, as every path does
        ErrorHandler().record_exception(e)
        leave(2)
    except BaseException as e:  # stopped by the agent (or a terminal), which reports it once: leave quietly
        if signum_of(e) is not None:
            leave(signum_of(e) + 128)
        leave_if_lost_peer(e, rank)
        raise
    leave(0)


def leave_if_lost_peer(error: BaseException, rank) -> None:
    """Another worker died or hung (``error`` says a peer is gone): one line and out, no traceback of ours; the
    agent (``thinwire train``'s, or the user's own torchrun) names that worker and restarts or stops the job.
    Returns for any other error."""
    if (gone := lost_peer(error)) is not None:
        print(f"thinwire[{rank}]: {LOST_PEER_SAYS} ({gone})", file=sys.stderr)
        leave(LOST_PEER_EXIT)


def leave(code: int) -> None:
    """Exit without running C++ static destructors: gloo's can abort ("terminate called without an
    active exception") at interpreter exit. Checkpoints are written atomically, so a stop between
    two writes loses nothing already saved."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
