"""``thinwire report DIR [DIR ...]``: plots of one or several runs (see :mod:`thinwire.report`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from thinwire.cli.common import COMMANDS


def add_parser(sub) -> None:
    p = sub.add_parser("report", help=COMMANDS["report"])
    p.add_argument("runs", nargs="+", help="run folders (each with metrics.jsonl)")
    p.add_argument("--out", help="folder for the PNGs (default: the first run's folder)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from thinwire.config import check_outputs, check_writable, mark_outputs
    from thinwire.report import PLOTS, report

    folder = Path(args.out or args.runs[0])  # without --out the plots go into the first run
    if args.out or folder.is_dir():  # where the plots go: --out names another folder
        check_writable(folder, "--out", folder=True)
        check_outputs(folder, PLOTS, "report", theirs=(".thinwire-run",))
    before = _stamps(folder, PLOTS)
    try:
        paths = report(args.runs, args.out)
    finally:  # a later report may replace what this one wrote, even if it stopped half-way (and only that)
        if _stamps(folder, PLOTS) != before and not (folder / ".thinwire-run").exists():
            mark_outputs(folder, "report")
    for path in paths:
        print(path)
    return 0


def _stamps(folder: Path, names: tuple[str, ...]) -> list:
    """Each of ``names`` in ``folder``: its modification time and size, or None where it is not there."""
    out = []
    for name in names:
        try:
            st = (folder / name).stat()
            out.append((st.st_mtime_ns, st.st_size))
        except OSError:
            out.append(None)
    return out
