"""Shadow runs: each lossy candidate's error with error feedback on the real gradients, before it is sent.

The guarded quantity is the relative compression error with error feedback, ``||r|| / ||g +
r_prev||`` (:func:`thinwire.compress.feedback.shadow_step`): the share of what was due that a step
left behind. :class:`ShadowRuns` measures it where the hook's own error feedback cannot:

1. **In the warm-up** (every bucket sent with ``auto``'s ``start``), every lossy candidate runs on
   each bucket's gradient with an error feedback of its own; ``errors[bucket][candidate]`` is the
   last step's error, which the first decision compares with the cap.
2. **A low-rank codec's first window in use** (PowerSGD): the distributed scheme's residual cannot
   measure its error, because each rank's residual also holds its gradient's difference from the
   average (which the ranks' residuals cancel in the sum, as in PyTorch's hook) and so reads near 1
   whatever the rank. So a bucket newly sent with it keeps its shadow for one window
   (``window`` steps), and the next check can ban it. After that the shadow stops (it costs about
   as much as the codec itself); PowerSGD's error with a warm start falls as training settles, so
   the first window is the one that decides.

The warm-up's shadows also time each codec's encode and decode on the real buckets
(:meth:`ShadowRuns.costs`), so ``auto`` need not time them again on made-up data.

A low-rank codec runs per matrix with a warm-started ``Q``, as it is sent
(:func:`~thinwire.compress.codecs.powersgd.local_approx`); the flat near-square view would
overstate its error. Cost: one encode and decode per candidate and bucket per warm-up step, and a
residual (fp32, the bucket's size) per candidate and bucket while it runs.

    >>> import torch
    >>> from thinwire.compress.spec import parse_codec_spec
    >>> runs = ShadowRuns({"topk:ratio=0.01": parse_codec_spec("topk:ratio=0.01")}, window=10)
    >>> runs.run(0, torch.randn(10_000), warm=True, current="none")
    >>> runs.errors[0]["topk:ratio=0.01"] > 0.9
    True
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from thinwire.compress.codecs import Codec
from thinwire.compress.codecs.powersgd import local_approx
from thinwire.compress.feedback import shadow_step

Key = tuple[int, str]  # (bucket, candidate spec)


class ShadowRuns:
    """Per bucket and lossy candidate: a residual, the error it measured, and for low-rank codecs
    the warm-start ``Q`` per matrix (see the module docstring). ``codecs``: candidate spec -> codec."""

    def __init__(self, codecs: dict[str, Codec], window: int) -> None:
        self.codecs, self.window = codecs, window
        self.errors: dict[int, dict[str, float]] = {}       # bucket -> candidate -> warm-up error
        self.residuals: dict[Key, torch.Tensor] = {}
        self.qs: dict[Key, dict] = {}                        # low-rank shadows' warm-start Q per matrix
        self.shapes: dict[int, list[tuple]] = {}             # bucket -> its parameters' shapes
        self.lowrank_errors: dict[int, list[float]] = {}     # in-use low-rank codec's error, this window
        self.since: dict[int, tuple[str, int]] = {}          # bucket -> (low-rank spec, step it was chosen)
        self.timings: dict[str, list[tuple[float, float, int]]] = {}  # spec -> (encode s, decode s, bytes) per run

    def wanted(self, bucket: int, step: int, current: str, warm: bool) -> bool:
        """Whether this bucket runs in shadow at ``step`` (sent with ``current``): in the warm-up, and
        in a low-rank codec's first window in use (whose end drops that shadow)."""
        if warm:
            return True
        spec, since = self.since.get(bucket, ("none", -1))
        if spec != current or not self.codecs[current].lowrank or bucket not in self.shapes:
            return False
        if step >= since + self.window:
            self.residuals.pop((bucket, current), None)
            self.qs.pop((bucket, current), None)
            return False
        return True

    def run(self, bucket: int, buf: torch.Tensor, *, warm: bool, current: str) -> None:
        """One step of every lossy candidate's shadow (warm-up), or of ``current``'s (in use)."""
        x = buf.detach().float().flatten()
        if not bool(torch.isfinite(x).all()):  # a step that is skipped (fp16's loss scale, a spike): folded into the
            return                             # residuals and warm-start Q it would make every later error NaN
        errors = {spec: self._step(bucket, spec, codec, x) for spec, codec in self.codecs.items()
                  if not codec.lossless and (warm or spec == current)}
        if warm:
            self.errors[bucket] = errors
        else:
            self.lowrank_errors.setdefault(bucket, []).append(errors[current])

    def costs(self) -> dict[str, tuple[float, float]]:
        """Candidate -> (encode, decode) seconds per fp32 byte, timed in the warm-up's shadows: the
        median over the runs on the largest bucket (the size the model prices best). Low-rank
        candidates, which run in shadow as a local approximation, are not timed here."""
        out = {}
        for spec, runs in self.timings.items():
            big = max(n for _, _, n in runs)
            on_big = [(e / n, d / n) for e, d, n in runs if n == big]
            out[spec] = (statistics.median(e for e, _ in on_big), statistics.median(d for _, d in on_big))
        return out

    def in_first_window(self, bucket: int, current: str, step: int) -> bool:
        """Whether ``bucket``, sent with low-rank ``current``, is in the window its shadow runs."""
        spec, since = self.since.get(bucket, ("", 0))
        return bucket in self.since and spec == current and step < since + self.window

    def keep_needed(self, choices: dict[int, str], step: int) -> None:
        """After a decision only the shadows of buckets newly sent with a low-rank codec go on (from
        their warm-up state, or fresh), for one window."""
        for bucket, spec in choices.items():
            if not self.codecs[spec].lowrank:
                self.since.pop(bucket, None)  # sent low-rank again later: a new first window
            elif self.since.get(bucket, ("",))[0] != spec:
                self.since[bucket] = (spec, step)
        for key in [k for k in self.residuals if choices.get(k[0]) != k[1] or not self.codecs[k[1]].lowrank]:
            del self.residuals[key]
            self.qs.pop(key, None)

    def in_use_errors(self, measured: dict[int, float], plan: Callable[[int], str]) -> dict[int, float]:
        """Each bucket's error in use over the window: ``measured`` by the hook's error feedback, but a
        bucket sent low-rank reads its shadow's mean instead (0 after its first window); starts a new
        window."""
        lowrank, self.lowrank_errors = self.lowrank_errors, {}
        return {i: statistics.fmean(lowrank[i]) if lowrank.get(i) else 0.0 if self.codecs[plan(i)].lowrank else e
                for i, e in measured.items()}

    def warmup_errors(self, buckets: list[int], lossy: list[str]) -> dict[int, dict[str, float]]:
        """Bucket -> lossy candidate -> its error at the warm-up's end (0 where it did not run)."""
        return {i: {s: self.errors.get(i, {}).get(s, 0.0) for s in lossy} for i in buckets}

    def _step(self, bucket: int, spec: str, codec: Codec, x: torch.Tensor) -> float:
        key = (bucket, spec)
        previous = self.residuals.get(key)
        shapes = self.shapes.get(bucket)
        if not codec.lowrank or shapes is None:
            timed = _Timed(codec)
            self.residuals[key], error, _ = shadow_step(timed, x, previous)
            if not codec.lowrank:
                self.timings.setdefault(spec, []).append((timed.encode_s, timed.decode_s, 4 * x.numel()))
            return error
        corrected = x + previous if previous is not None and previous.numel() == x.numel() else x.clone()
        residual = corrected - local_approx(corrected, shapes, codec.config, self.qs.setdefault(key, {}))
        self.residuals[key] = residual
        norm = float(corrected.norm())
        return float(residual.norm()) / norm if norm > 0 else 0.0


class _Timed:
    """``codec``'s round trip (what :func:`~thinwire.compress.feedback.shadow_step` calls), timed."""

    def __init__(self, codec: Codec) -> None:
        self.codec, self.encode_s, self.decode_s = codec, 0.0, 0.0

    def roundtrip(self, x: torch.Tensor, meta) -> torch.Tensor:
        t0 = time.perf_counter()
        payload = self.codec.compress(x, meta)
        t1 = time.perf_counter()
        out = self.codec.decompress(payload, meta)
        self.encode_s, self.decode_s = t1 - t0, time.perf_counter() - t1
        return out
