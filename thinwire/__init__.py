"""thinwire: data-parallel PyTorch training over slow, uneven links and on small devices.

The one-line entry point for your own DDP script::

    state = thinwire.attach(ddp_model, "int8")     # compressed, error-fed gradient averaging
    mode = thinwire.sync(ddp_model, "delayed", codec="int8")   # or local:period=H, diloco:period=H

The names below are imported on first use, so ``thinwire``'s command line and its worker processes can take
their stop signals before torch is loaded (a Ctrl-C then ends them with one line, not an import's traceback).
"""

import importlib

__version__ = "0.1.0"
__all__ = ["attach", "sync", "CommState", "Workload", "__version__"]
_WHERE = {"attach": "thinwire.api", "sync": "thinwire.api", "CommState": "thinwire.compress.hook",
          "Workload": "thinwire.workloads.base"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'thinwire' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
