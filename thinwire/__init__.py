"""thinwire: data-parallel PyTorch training over slow, uneven links and on small devices.

The one-line entry point for your own DDP script::

    state = thinwire.attach(ddp_model, "int8")     # compressed, error-fed gradient averaging
    mode = thinwire.sync(ddp_model, "delayed", codec="int8")   # or local:period=H, diloco:period=H
"""

from thinwire.api import attach, sync
from thinwire.compress.hook import CommState
from thinwire.workloads.base import Workload

__version__ = "0.1.0"
__all__ = ["attach", "sync", "CommState", "Workload", "__version__"]
