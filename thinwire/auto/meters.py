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

from thinwire.perf.collectives import switch_pace

DEFAULT_ALPHA_S = 1e-4


class LinkMeter:
    """(bytes this rank sent, seconds) of each collective; a least-squares ``t = a + beta * bytes``."""

    def __init__(self, keep: int = 64) -> None:
        self.samples: collections.deque = collections.deque(maxlen=keep)
        self.switched: collections.deque = collections.deque(maxlen=keep)  # (bytes up, seconds) via the switch
        self._last_done = 0.0  # when the last timed collective completed
        self._port = None

    def wrap_switch(self, port) -> None:
        """Time each exchange through ``port`` (a :class:`~thinwire.compress.switch.SwitchPort`), once."""
        if port is None or port is self._port:
            return
        self._port, exchange = port, port.all_reduce

        def timed(*args, **kwargs):
            before, t0 = port.bytes_sent, time.perf_counter()
            out = exchange(*args, **kwargs)
            self.switched.append((port.bytes_sent - before, time.perf_counter() - t0))
            return out
        port.all_reduce = timed

    def switch_estimate(self) -> float | None:
        """The switch's pace (:func:`thinwire.perf.collectives.switch_pace`), the median over the timed
        exchanges; None before any."""
        done = [(b, t) for b, t in self.switched if b > 0]
        if not done:
            return None
        return statistics.median(switch_pace(t, b, alpha=DEFAULT_ALPHA_S) for b, t in done)

    def wrap(self, wire) -> None:
        for name in ("all_reduce", "all_gather", "all_to_all"):
            setattr(wire, name, self._timed(wire, getattr(wire, name)))
        wire.all_reduce_async = self._timed_async(wire, wire.all_reduce_async)

    def _record(self, sent: int, issued: float) -> None:
        """A collective issued at ``issued`` just completed. One issued while an earlier one was
        still running waited for it (a process group runs its collectives in order), so its time
        counts from the later of its issue and the earlier one's completion."""
        now = time.perf_counter()
        if sent > 0:
            self.samples.append((sent, now - max(issued, self._last_done)))
        self._last_done = now

    def _timed(self, wire, fn):
        def timed(t):
            before, t0 = wire.bytes_sent, time.perf_counter()
            out = fn(t)
            self._record(wire.bytes_sent - before, t0)
            return out
        return timed

    def _timed_async(self, wire, fn):
        def timed(t):
            before, t0 = wire.bytes_sent, time.perf_counter()
            fut = fn(t)
            sent = wire.bytes_sent - before

            def done(f):
                self._record(sent, t0)
                return f.value()
            return fut.then(done)
        return timed

    def estimate(self, p: int) -> tuple[float, float]:
        """(alpha seconds per message, beta seconds per byte); beta = inf-like before any sample.

        A collective's time on a busy host is its transfer plus any wait for a late peer or a core,
        so a least-squares line through a few dozen such samples can come out at any slope
        (``docs/auto.md``). Instead, alpha is taken as ``DEFAULT_ALPHA_S`` per message
        (a ring of ``p`` ranks sends ``2 (p - 1)`` in a row) and beta is the median of
        ``(t - messages * alpha) / bytes`` over the collectives where that alpha is at most half the
        time (all of them if none is that large)."""
        if not self.samples:
            return DEFAULT_ALPHA_S, 1.0
        fixed = 2 * max(1, p - 1) * DEFAULT_ALPHA_S
        large = [(b, t) for b, t in self.samples if t >= 2 * fixed] or list(self.samples)
        return DEFAULT_ALPHA_S, max(1e-12, statistics.median(max(t - fixed, 0.5 * t) / b for b, t in large))


class ComputeMeter:
    """Per step: forward start -> first gradient (``pre``) and first -> last gradient (``backward``).

    The first backward hooks every parameter and notes the order their gradients arrive in; from
    then on only the first and the last of that order keep a hook (a Python call per parameter and
    step costs ~10 us, a few percent of a small model's step on a fraction of a core)."""

    def __init__(self, keep: int = 20) -> None:
        self.pre: collections.deque = collections.deque(maxlen=keep)
        self.backward: collections.deque = collections.deque(maxlen=keep)
        self._fwd = self._first = self._last = None
        self._hooks: dict[int, object] = {}   # id(parameter) -> its hook's handle
        self._order: list[int] | None = None  # id(parameter) in gradient order, until the first backward ends

    def attach(self, model: torch.nn.Module) -> None:
        model.register_forward_pre_hook(self._on_forward)
        self._order = []
        for p in model.parameters():
            if p.requires_grad and id(p) not in self._hooks:
                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_forward(self, *_):
        self._close()
        self._fwd, self._first, self._last = time.perf_counter(), None, None

    def _on_grad(self, param) -> None:
        now = time.perf_counter()
        self._first = self._first or now
        self._last = now
        if self._order is not None:
            self._order.append(id(param))

    def _keep_ends(self) -> None:
        """After the first backward: only the first and the last parameter in gradient order keep a hook."""
        ends = {self._order[0], self._order[-1]}
        for key in [k for k in self._hooks if k not in ends]:
            self._hooks.pop(key).remove()
        self._order = None

    def _close(self) -> None:
        if self._fwd is not None and self._first is not None:
            self.pre.append(self._first - self._fwd)
            self.backward.append(self._last - self._first)
            if self._order:
                self._keep_ends()

    def estimate(self) -> tuple[float, float]:
        if not self.backward:
            return 0.0, 0.0
        return statistics.median(self.pre), statistics.median(self.backward)


class ErrorMeter:
    """Per bucket, over a window: the mean of each step's ``||r|| / ||g + r_prev||``.

    With error feedback a codec is handed the corrected gradient ``g + r_prev`` and keeps what it
    did not deliver, ``r = (g + r_prev) - sent``, for the next step: ``||r|| / ||g + r_prev||`` is
    the relative compression error with error feedback, the share of what was due that stayed
    behind. A codec that loses little each step (bf16 ~0.004, int8 ~0.1) keeps it small; a sparse
    or low-rank codec at a strong ratio leaves most of it behind every step (near 1).
    """

    def __init__(self) -> None:
        self.errors: dict[str, list[float]] = {}

    def wrap(self, feedback) -> None:
        update = feedback.update

        def observed(key, corrected, sent, layout=None):
            norm = float(corrected.norm())  # before: update turns ``corrected`` into the residual
            update(key, corrected, sent, layout)
            if norm > 0:
                self.errors.setdefault(key, []).append(float(feedback.residuals[key][1].norm()) / norm)
        feedback.update = observed

    def forget(self, keys: list[str]) -> None:
        """Drop these keys' errors so far in the window (their bucket changed codec: they were the old one's)."""
        for k in keys:
            self.errors.pop(k, None)

    def window_errors(self, keys: list[str]) -> list[float]:
        """Each key's mean error over the window since the last call (0 when nothing was compressed); resets."""
        out = [sum(self.errors[k]) / len(self.errors[k]) if self.errors.get(k) else 0.0 for k in keys]
        self.errors.clear()
        return out

