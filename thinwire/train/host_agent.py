"""One emulated host's agent: ``python -m thinwire.train.host_agent ARGS`` is ``torchrun ARGS`` (torch's own
elastic agent, :func:`torch.distributed.run.run`), told in one line where torchrun prints a traceback.

torchrun turns a stop signal into ``SignalException`` and a failed worker into ``ChildFailedError``, and its
``main`` lets either end the process with Python's traceback. The launcher (:mod:`.cluster_launch`) stops the
hosts with SIGTERM and a Ctrl-C reaches the agent of the host on the console, so each stop printed a
traceback, and a failed worker a page of torchrun's error box after the worker's own message. Here the
agent has already stopped its workers when these arrive; it leaves with ``128 + signal`` or the worker's
exit code, and the launcher names the host and shows its log.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except SignalException as e:  # stopped: its workers were stopped first
        return 128 + int(e.sigval)
    except ChildFailedError as e:  # the worker said why above this line
        rank, failure = e.get_first_failure()
        code = failure.exitcode
        how = f"was killed by {failure.signal_name()}" if code < 0 else f"failed (exit code {code})"  # as launch.py says it
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
        said = str(message or "").strip().splitlines() if failure.error_file_data else []
        print(f"thinwire: the worker of rank {rank} {how}" + (f": {said[0][:300]}" if said else "") + "; its agent "
              "stopped", file=sys.stderr, flush=True)
        return 1
    except RendezvousError as e:  # the store went with the first host's agent (its run ended or failed) while this
        # agent still closed its rendezvous: its worker's own output, if it failed, is above this line
        print(f"thinwire: this host's agent lost the rendezvous store, which the first host's agent holds "
              f"({type(e).__name__}); its agent stopped", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    from thinwire.signals import leave_quietly_on_stop

    leave_quietly_on_stop()  # until torchrun's agent installs its handlers: torch's import may swallow a Ctrl-C
    sys.exit(main(sys.argv[1:]))
