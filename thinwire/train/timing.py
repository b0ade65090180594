"""Split a step's time into compute and communication wait, for any DDP hook (or none).

A post-accumulate-grad hook on every parameter notes when the last gradient of backward was
produced. Whatever backward still takes after that is DDP waiting for outstanding buckets: the
communication that was not hidden behind computation (``comm_wait_s``). This works the same for
thinwire's hook, PyTorch's own hooks and plain DDP, so contenders are measured alike.
"""

from __future__ import annotations

import time

from torch import nn


class GradReadyClock:
    def __init__(self, model: nn.Module) -> None:
        self.last = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(self._tick)
                         for p in model.parameters() if p.requires_grad]

    def _tick(self, _param) -> None:
        self.last = time.perf_counter()

    def exposed_wait(self, backward_end: float, backward_start: float) -> float:
        """Seconds of backward spent after the last gradient was ready (clamped to the backward)."""
        if self.last < backward_start:
            return 0.0
        return max(0.0, backward_end - self.last)
