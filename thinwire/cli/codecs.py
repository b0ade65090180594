"""``thinwire codecs``: every form of ``--compression``: the codecs with their parameters, defaults and
allowed ranges, ``auto`` and PyTorch's own hooks."""

from __future__ import annotations

from thinwire.cli.common import COMMANDS


def add_parser(sub) -> None:
    p = sub.add_parser("codecs", help=COMMANDS["codecs"])
    p.set_defaults(func=run)


def run(args) -> int:
    from thinwire.commspec import comm_help

    print(comm_help())
    return 0
