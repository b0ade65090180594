"""``thinwire report DIR [DIR ...]``: plots of one or several runs (see :mod:`thinwire.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="plot loss vs step and wall-clock, and the step-time breakdown")
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl)")
    p.add_argument("--out", help="folder for the PNGs (default: the first run's folder)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from thinwire.config import check_writable
    from thinwire.report import report

    if args.out or Path(args.runs[0]).is_dir():  # without --out the plots go into the first run
        check_writable(args.out or args.runs[0], "--out", folder=True)

    for path in report(args.runs, args.out):
        print(path)
    return 0
