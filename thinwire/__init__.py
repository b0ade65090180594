"""thinwire: data-parallel PyTorch training over slow, uneven links and on small devices."""

__version__ = "0.1.0"
