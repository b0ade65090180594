"""What ``auto`` measures on each rank: collective times, compute phases, error feedback's backlog.

All three observe without changing what they observe: :class:`LinkMeter` wraps a ``Wire``'s
collectives with a timer, :class:`ComputeMeter` adds autograd/forward hooks, :class:`ErrorMeter`
wraps ``ErrorFeedback.update``.
"""

from __future__ import annotations

import collections
import statistics
import time

import torch

DEFAULT_ALPHA_S = 1e-4


class LinkMeter:
    """(bytes this rank sent, seconds) of each collective; a least-squares ``t = a + beta * bytes``."""

    def __init__(self, keep: int = 64) -> None:
        self.samples: collections.deque = collections.deque(maxlen=keep)

    def wrap(self, wire) -> None:
        for name in ("all_reduce", "all_gather", "all_to_all"):
            setattr(wire, name, self._timed(wire, getattr(wire, name)))

    def _timed(self, wire, fn):
        def timed(t):
            before, t0 = wire.bytes_sent, time.perf_counter()
            out = fn(t)
            sent = wire.bytes_sent - before
            if sent > 0:
                self.samples.append((sent, time.perf_counter() - t0))
            return out
        return timed

    def estimate(self, p: int) -> tuple[float, float]:
        """(alpha seconds per message, beta seconds per byte); beta = inf-like before any sample."""
        if not self.samples:
            return DEFAULT_ALPHA_S, 1.0
        xs = [float(b) for b, _ in self.samples]
        ys = [t for _, t in self.samples]
        if max(xs) > 2 * min(xs):
            slope, intercept = statistics.linear_regression(xs, ys)
            if slope > 0:
                return max(0.0, intercept) / max(1, 2 * (p - 1)), slope
        return DEFAULT_ALPHA_S, max(1e-12, statistics.median(t / b for b, t in self.samples))


class ComputeMeter:
    """Per step: forward start -> first gradient (``pre``) and first -> last gradient (``backward``)."""

    def __init__(self, keep: int = 20) -> None:
        self.pre: collections.deque = collections.deque(maxlen=keep)
        self.backward: collections.deque = collections.deque(maxlen=keep)
        self._fwd = self._first = self._last = None

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._on_forward)
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_forward(self, *_):
        self._close()
        self._fwd, self._first, self._last = time.perf_counter(), None, None

    def _on_grad(self, _param) -> None:
        now = time.perf_counter()
        self._first = self._first or now
        self._last = now

    def _close(self) -> None:
        if self._fwd is not None and self._first is not None:
            self.pre.append(self._first - self._fwd)
            self.backward.append(self._last - self._first)

    def estimate(self) -> tuple[float, float]:
        if not self.backward:
            return 0.0, 0.0
        return statistics.median(self.pre), statistics.median(self.backward)


class ErrorMeter:
    """Per bucket, over a window: ``||r_end - r_start|| / ||sum of gradients||`` (EF's relative error)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.start: dict[str, torch.Tensor] = {}
        self.last: dict[str, torch.Tensor] = {}

    def wrap(self, feedback) -> None:
        update = feedback.update

        def observed(key, corrected, sent, layout=None):
            held = feedback.residuals.get(key)
            prev = held[1] if held is not None and held[1].numel() == corrected.numel() else None
            grad = corrected - prev if prev is not None else corrected
            self.sums[key] = self.sums[key] + grad if key in self.sums and self.sums[key].numel() == grad.numel() \
                else grad.clone()
            self.start.setdefault(key, prev.clone() if prev is not None else torch.zeros_like(corrected))
            update(key, corrected, sent, layout)
            self.last[key] = feedback.residuals[key][1]
        feedback.update = observed

    def window_errors(self, keys: list[str]) -> list[float]:
        """Each key's error over the window since the last call (0 when nothing was compressed); resets."""
        out = []
        for key in keys:
            if key in self.sums and key in self.last and self.sums[key].numel() == self.last[key].numel():
                total = float(self.sums[key].norm())
                out.append(float((self.last[key] - self.start[key]).norm()) / total if total > 0 else 0.0)
            else:
                out.append(0.0)
        self.sums.clear()
        self.start = {k: v.clone() for k, v in self.last.items()}
        return out
