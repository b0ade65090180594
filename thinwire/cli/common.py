"""Arguments every planning subcommand shares (profile, simulate, plan): the workload, its model
options as ``--set model.KEY=VALUE`` (as ``thinwire train`` takes them) and its data."""

from __future__ import annotations

from thinwire.config import check


def add_workload_args(p, *, from_profile: bool = False) -> None:
    p.add_argument("--workload", help="charlm, digits, or package.module:function (default: "
                   + ("the --profile's workload, else charlm)" if from_profile else "charlm)"))
    p.add_argument("--set", action="append", default=[], metavar="model.KEY=VALUE",
                   help="a model option, e.g. --set model.width=256 (repeatable), as `thinwire train` takes it")
    p.add_argument("--data", help="text file or folder for charlm (only to measure without --profile)")


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
    """The workload and model options asked for: ``--workload`` and ``--set model.*``; where neither is given,
    the ``--profile``'s own (what it measured: a user's workload profiled once need not be named again),
    else charlm with its defaults."""
    model = model_options(args.set)
    if args.workload is not None:
        return args.workload, model
    if getattr(args, "profile", None) and not model:
        from thinwire.measure.file import load_profile

        profile = load_profile(args.profile)
        return profile.workload, dict(profile.model)
    return "charlm", model
