"""``thinwire``: thin subcommands over library functions; all validation happens before dispatch."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

from thinwire.errors import ThinwireError
from thinwire.signals import Stopped, deferred, signum_of, stop_signals_raise


def build_parser() -> argparse.ArgumentParser:
    from thinwire.cli import report, train

    parser = argparse.ArgumentParser(prog="thinwire", description="thinwire: data-parallel "
                                     "PyTorch training over slow, uneven links and on small devices.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train.add_parser(sub)
    report.add_parser(sub)
    for name in ("codecs", "cluster", "profile", "simulate", "plan", "doctor", "bench"):
        if importlib.util.find_spec(f"thinwire.cli.{name}") is not None:  # subcommands still being built
            importlib.import_module(f"thinwire.cli.{name}").add_parser(sub)
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
                import torch  # noqa: F401
            args = build_parser().parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
