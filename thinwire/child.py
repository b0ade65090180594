"""The environment of the processes thinwire starts itself: probes, co-run copies, emulated hosts' agents."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])  # the checkout (or site-packages) thinwire is imported from


def pythonpath() -> str:
    """``PYTHONPATH`` for a child: thinwire's own source first, then the caller's ``PYTHONPATH``, where a user's
    ``--workload package.module:function`` is found (replacing it, a probe of the user's workload could not
    import it)."""
    parts = [ROOT, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return os.pathsep.join(dict.fromkeys(parts))
