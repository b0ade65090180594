"""``thinwire``: thin subcommands over library functions; all validation happens before dispatch."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys

from thinwire.errors import ThinwireError
from thinwire.signals import STOP_SIGNALS, Stopped, deferred, signum_of, stop_signals_raise


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line; only the subcommand ``argv`` names gets its full parser (its module may import torch),
    every other one its line of ``thinwire --help``, so help and mistyped flags answer at once."""
    from thinwire.cli.common import COMMANDS

    words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
    chosen = words[0] if words else None
    parser = argparse.ArgumentParser(prog="thinwire", description="thinwire: data-parallel "
                                     "PyTorch training over slow, uneven links and on small devices.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        if name == chosen:
            importlib.import_module(f"thinwire.cli.{name}").add_parser(sub)
        else:
            sub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a stop signal anywhere ends it with one line and ``128 + signum``.

    torch is imported with stop signals held back: its C extension imports numpy and, when that import
    raises, only warns and goes on, so a Ctrl-C landing inside it was swallowed and left numpy half
    imported (the run then went on, or failed later in numpy with a RecursionError)."""
    logging.basicConfig(level=logging.INFO, format="thinwire: %(message)s")
    try:
        with stop_signals_raise():  # SIGTERM and SIGHUP unwind through every cleanup, as Ctrl-C does
            with deferred():  # a stop signal during torch's import is raised once it is done, see below
                parser = build_parser(argv)
            args = parser.parse_args(argv)  # --help and a mistyped flag answer here, before torch is loaded
            with deferred():
                import torch  # noqa: F401
            return int(args.func(args) or 0)
    except ThinwireError as e:
        print(f"thinwire: error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # a stop signal, maybe wrapped by the code it interrupted (torch.save)
        if signum_of(e) is None:
            raise
        stopped = Stopped(signum_of(e))
        print(f"thinwire: {stopped}; everything already saved is kept", file=sys.stderr)
        return stopped.exit_code


def run() -> None:
    """The ``thinwire`` command: :func:`main`, then out with its code. A stop signal after the command is done (in
    the interpreter's shutdown and torch's exit hooks, up to ~0.5 s) ends the exit sooner with that code: it
    killed a finished run with 143 and no word, which a job scheduler reads as a failed run."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()

    def leave(signum, frame):
        os._exit(code)

    for s in STOP_SIGNALS:
        signal.signal(s, leave)
    sys.exit(code)


if __name__ == "__main__":
    run()
