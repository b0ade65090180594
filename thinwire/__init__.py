"""thinwire: data-parallel PyTorch training over slow, uneven links and on small devices.

The one-line entry point for your own DDP script::

    state = thinwire.attach(ddp_model, "int8")     # compressed, error-fed gradient averaging
"""

from thinwire.api import attach
from thinwire.compress.hook import CommState
from thinwire.workloads.base import Workload

__version__ = "0.1.0"
__all__ = ["attach", "CommState", "Workload", "__version__"]
