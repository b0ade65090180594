"""Arguments every planning subcommand shares (profile, simulate, plan): the workload, its model
options as ``--set model.KEY=VALUE`` (as ``thinwire train`` takes them) and its data."""

from __future__ import annotations

from thinwire.config import check
from thinwire.errors import ConfigError

# every subcommand and its line in `thinwire --help`: main builds the chosen one's parser only (its module may
# import torch), the others from this table
COMMANDS = {
    "train": "train a workload: data-parallel with a codec and a sync mode, or pipelined",
    "report": "plot loss vs step and wall-clock, and the step-time breakdown",
    "codecs": "list every form of --compression: codecs and their parameters, auto, torch:*",
    "cluster": "emulate a cluster on this machine (namespaces, tc, cgroups; root)",
    "profile": "measure compute, codec and network costs for the simulator",
    "simulate": "predict step time, scaling and energy before running",
    "plan": "plan batch shares, hosts, grouping and codecs for a cluster, and explain why",
    "doctor": "what the network costs this job and what would help, in about a minute",
}


def add_workload_args(p, *, from_profile: bool = False) -> None:
    p.add_argument("--workload", help="charlm, digits, or package.module:function (default: "
                   + ("the --profile's workload, else charlm)" if from_profile else "charlm)"))
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                   help="a model option, e.g. --set model.width=256 (repeatable), as `thinwire train` takes it")
    p.add_argument("--data", help="text file or folder for charlm" + (" (only to measure without --profile)" if from_profile else ""))


def model_options(sets: list[str]) -> dict:
    """``--set model.width=256`` -> ``{"width": 256}``; only ``model.*`` keys describe the workload."""
    from thinwire.train.config import parse_override

    out = {}
    for item in sets:
        keys, value = parse_override(item)
        check(len(keys) == 2 and keys[0] == "model", "--set", item, "model.KEY=VALUE such as model.width=256",
              "Other training settings do not change what is measured or planned.")
        out[keys[1]] = value
    return out


def workload_of(args) -> tuple[str, dict]:
    """The workload and model options asked for: ``--workload`` and ``--set model.*``; without ``--workload``,
    the ``--profile``'s own (what it measured: a user's workload profiled once need not be named again), its
    model options as ``--set`` changes them, else charlm."""
    model = model_options(args.set)
    if args.workload is not None:
        return args.workload, model
    if getattr(args, "profile", None):
        from thinwire.measure.file import load_profile

        profile = load_profile(args.profile)
        return profile.workload, {**dict(profile.model), **model}
    return "charlm", model


def split_codecs(text: str) -> tuple[str, ...]:
    """``--codecs``' specs: split at commas, except those between one codec's parameters
    (``none,int8:block=64,stochastic=true`` is two codecs; a codec's name never holds ``=``)."""
    items: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:  # `--codecs ''` or `none,,int8`: a codec left out by mistake, not "the default list"
            raise ConfigError("--codecs", text, "comma-separated codec specs such as none,bf16,int8",
                              "Name every codec (leave --codecs out for the default list).")
        if "=" in piece.split(":", 1)[0] and items and ":" in items[-1]:
            items[-1] += "," + piece
        else:
            items.append(piece)
    from thinwire.compress.spec import parse_codec_spec

    for item in items:
        try:
            parse_codec_spec(item)
        except ConfigError as e:  # a name no codec has was blamed on `compression`, which these commands lack
            if e.field != "compression":
                raise
            raise ConfigError("--codecs", item, e.allowed, e.fix) from None
    return tuple(items)


def wide_console(**kwargs):
    """A rich Console that does not cut a table's numbers when the output is a pipe or a log (rich takes 80 columns
    there, and ``simulate``'s table lost its digits to ellipses: "0.1…" for 0.183); a terminal keeps its width."""
    import sys

    from rich.console import Console

    stream = sys.stderr if kwargs.get("stderr") else sys.stdout
    return Console(width=None if stream.isatty() else 200, **kwargs)

