"""``thinwire codecs``: the codecs, their parameters, defaults and allowed ranges."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("codecs", help="list gradient codecs and their parameters")
    p.set_defaults(func=run)


def run(args) -> int:
    from thinwire.compress.spec import codec_help

    print(codec_help())
    print("auto: pick the codec per bucket from the measured link and compute (thinwire.auto)")
    print("PyTorch's own hooks, for comparison: torch:none, torch:fp16, torch:bf16, torch:powersgd:rank=R")
    return 0
