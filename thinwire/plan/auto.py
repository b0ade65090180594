"""``auto``: an online plan that picks each bucket's codec from measured link, compute and codec costs.

How it works (a :class:`~thinwire.compress.hook.Policy`; every rank answers identically):

0. **Start light.** Until its first decision ``auto`` sends ``start``: bf16 where it is a candidate
   (the default), else none. bf16 halves the bytes of fp32 at the cost of one cast, and its error
   (relative, 0.002 on charlm, unbiased rounding) is the smallest of any codec; it is what PyTorch
   offers as its light hook and what a fast link ends up with anyway. Starting in fp32 cost 11
   uncompressed steps and a trial before bf16 on every run (4 emulated hosts at 1 Gbit/s: 6% over
   thinwire bf16's time to target). ``auto:start=none`` sends fp32 until the first decision.
1. **Measure, passively, on every rank.** Once bound to the hook's state and the model
   (:meth:`AutoPolicy.bind`), it times every collective the hook issues (bytes as ``Wire`` counts
   them, seconds), the forward start and the first/last gradient of each backward (autograd hooks),
   and, through error feedback's ``update``, what each compressed bucket holds back.
2. **Agree.** After ``warmup_steps`` and then ``baseline_steps`` (5) more steps sent as at the
   start, and
   every ``check_every`` steps from then on, on the communication thread at the
   first bucket of the step (all ranks reach it in the same place of the same collective
   sequence), one all-reduce (MAX) merges the ranks' measurements: the slowest rank's compute and
   codec costs, the fastest rank's transfer time per byte (the others' include waiting for late
   peers). From then on every input of the decision is identical on all ranks.
3. **Decide** with the performance model (:func:`thinwire.plan.choose.choose`): per bucket, the
   candidate that minimizes the predicted step time. It decides after the baseline window (the
   warm-up's own steps are no measure of the plan: start-up, and the shadow runs below), again when the
   measured link rate moves by more than ``rebalance_change`` (30%) from the rate of the last
   decision, and when the accuracy guard bans a codec from a bucket.
4. **Guard accuracy**, before and after. The guarded quantity is the relative compression error
   with error feedback, ``||r|| / ||g + r_prev||``: the share of what was due that a step left
   behind. Before any codec is used, every lossy candidate runs in shadow on the warm-up's real
   gradients with an error feedback of its own (:meth:`AutoPolicy.observe`); a candidate above
   ``max_error`` (0.1) at the warm-up's last step is not considered for that bucket. Once used,
   the same quantity, averaged over the window (:class:`~thinwire.plan.meters.ErrorMeter`), is
   checked at every check: above ``max_error`` the codec is banned from the bucket and the plan
   is re-decided. PowerSGD's shadow runs per matrix with a warm-started Q, as it is sent, and
   goes on for its first window in use (its distributed residual cannot measure it; see
   :meth:`AutoPolicy.observe`). Measured on charlm (446k parameters, `benchmarks/compare.py`
   model, 4 ranks) at the warm-up's end: bf16 0.002, int8 0.008, qsgd ~0.2, top-k 10% 0.3-0.6,
   PowerSGD rank 8 0.28-0.32, rank 4 0.42-0.48, top-k 1% 0.80-0.86. The cap (0.1) is set by what
   those errors cost at equal samples when the learning rate is stable (480 steps,
   3 seeds, ``benchmarks/results/compare_long.md``): bf16 and int8 end within 0.5% of fp32 DDP's
   loss, QSGD 1.7-2.4% and PowerSGD rank 8 3.3-4.0% above it, on every seed. (At a learning
   rate on the edge of stability the ranking is noise, ``benchmarks/results/lr_sweep.md``; the
   cap was 0.5 when it was set from such runs.)
   A user who will trade loss for speed raises it: ``auto:max_error=0.5`` admits PowerSGD rank 8.
5. **Switch only for a real gain.** A codec changes the numerics and the model's predictions
   are good to a few percent (``benchmarks/results/validation.md``), and every change of plan
   costs a trial, so a candidate must be predicted ``min_gain`` (10%) faster than the plan in use
   (bf16 or none at the start) to replace it: on a fast link, where compression buys a few percent
   at best, ``auto`` stays with no compression or bf16.
6. **Keep a switch only if the clock agrees.** The model's inputs are measured, but on a host whose
   collectives are bound by its CPU rather than its link, the transfer time per byte it measured
   under one codec does not carry over to another (seen: 4 emulated hosts on 2 cores at 10 Gbit/s,
   where the model predicted int8 13% faster and int8 ran slower). So a change of plan is a trial:
   the next window's median step time (first bucket to the next step's first bucket, less the time
   ``auto`` itself spent on shadow runs and checks) must be at least ``keep_gain`` (5%) below the
   window's before it, and the window's step times must be faster than the window's before by a
   one-sided Mann-Whitney U test at ``keep_p`` (0.05; each rank's slowest-rank step times, the
   same on every rank). Not 5% faster: the plan is reverted and the codecs it tried are left out of
   those buckets until the link moves their way: a codec that sends fewer bytes than the plan in
   use until the link is ``rebalance_change`` slower than when it was rejected, one that sends more
   until it is that much faster (a faster link makes a rejected stronger codec pay less still; seen:
   4 emulated hosts at 10 Gbit/s, int8 rejected at 398 Mbit/s measured and tried again, and rejected
   again, when noise moved the measured rate to 520 Mbit/s). Faster by the median but not surely: the old plan is timed
   again for a window, then the new one, testing all steps so far after each (the windows
   alternate, so a slow spell of the host falls on both plans); after ``trial_windows`` (3) windows
   the medians decide. The test is there because a window's median moves by 5-10% between
   windows on a noisy host (seen: 4 emulated hosts on 2 cores at 10 Gbit/s kept int8 on a 6%
   faster window and ran 9% slower over the run); a real gain of a codec on a slow link (100 Mbit/s:
   137 against 300 ms) passes it with every step of one window below every step of the other. The
   first trial is timed against the baseline window, not the warm-up: against the warm-up's six
   steps (start-up, shadow runs) bf16 at 1 Gbit/s, 7% faster than fp32 over the run, was "not surely
   faster" on 2 seeds of 3 and reverted to fp32 for good. The link rate a later "link moved" is
   measured against is the rate under the plan that was kept.

Every decision is logged (``thinwire.plan`` logger) with its reason and kept in ``decisions``.

Example::

    policy = AutoPolicy(AutoConfig(candidates=("none", "bf16", "topk:ratio=0.01")))
    state = thinwire.attach(ddp_model, policy)      # attach calls policy.bind(state, model)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from thinwire.compress.codecs import Codec
from thinwire.compress.hook import Policy
from thinwire.compress.spec import parse_codec_spec
from thinwire.config import check
from thinwire.perf.model import Bucket, Compute, Network
from thinwire.plan.choose import choose
from thinwire.plan.meters import ComputeMeter, ErrorMeter, LinkMeter

log = logging.getLogger("thinwire.plan")


@dataclasses.dataclass(kw_only=True, frozen=True)
class AutoConfig:
    candidates: tuple[str, ...] = ("none", "bf16", "int8", "powersgd:rank=8", "topk:ratio=0.01")
    warmup_steps: int = 6
    baseline_steps: int = 5
    check_every: int = 10
    rebalance_change: float = 0.3
    max_error: float = 0.1
    min_gain: float = 0.10
    keep_gain: float = 0.05
    keep_p: float = 0.05
    trial_windows: int = 3
    start: str = ""  # the plan before the first decision; "" is bf16 where it is a candidate, else none

    def __post_init__(self) -> None:
        check("none" in self.candidates, "auto.candidates", self.candidates, "a list that includes 'none'")
        for c in self.candidates:
            parse_codec_spec(c)
        if not self.start:
            object.__setattr__(self, "start", "bf16" if "bf16" in self.candidates else "none")
        check(self.start in self.candidates, "auto.start", self.start, f"one of the candidates ({'|'.join(self.candidates)})",
              "The codec sent before the first decision; bf16 or none.")
        check(self.warmup_steps >= 1, "auto.warmup_steps", self.warmup_steps, "an integer >= 1")
        check(self.baseline_steps >= 0, "auto.baseline_steps", self.baseline_steps, "an integer >= 0",
              "0 decides at the warm-up's end, timing the first trial against the warm-up's steps.")
        check(self.check_every >= 1, "auto.check_every", self.check_every, "an integer >= 1")
        check(0 < self.rebalance_change < 10, "auto.rebalance_change", self.rebalance_change, "a fraction > 0")
        check(self.max_error > 0, "auto.max_error", self.max_error, "a relative error > 0")
        check(0 <= self.min_gain < 1, "auto.min_gain", self.min_gain, "a fraction in [0, 1)")
        check(-1 < self.keep_gain < 1, "auto.keep_gain", self.keep_gain, "a fraction in (-1, 1)")
        check(self.trial_windows >= 1, "auto.trial_windows", self.trial_windows, "an integer >= 1",
              "1 judges a trial on its first window alone.")
        check(0 < self.keep_p <= 1, "auto.keep_p", self.keep_p, "a probability in (0, 1]",
              "1 keeps any trial whose median step is keep_gain faster, however noisy.")


def parse_auto_spec(spec: str) -> AutoConfig:
    """``"auto"`` or ``"auto:max_error=0.3,check_every=20,candidates=none|bf16|topk:ratio=0.01"``.

    ``candidates`` are separated by ``|`` (a candidate's own parameters keep their ``:``/``=``;
    only one parameter per candidate fits this syntax).
    """
    from thinwire.errors import ConfigError

    name, _, rest = spec.partition(":")
    if name.strip().lower() != "auto":
        raise ConfigError("compression", spec, "auto or auto:key=value,...")
    fields = {f.name: f.type for f in dataclasses.fields(AutoConfig)}
    kwargs: dict[str, Any] = {}
    for item in _split_top(rest):
        key, eq, value = (t.strip() for t in item.partition("="))
        if not eq or key not in fields:
            raise ConfigError("auto parameter", item, f"key=value with key one of {', '.join(fields)}")
        if key == "candidates":
            kwargs[key] = tuple(v.strip() for v in value.split("|"))
            continue
        if key == "start":
            kwargs[key] = value
            continue
        number = int if fields[key] in (int, "int") else float
        try:
            kwargs[key] = number(value)
        except ValueError:
            raise ConfigError(f"auto.{key}", value, "an integer" if number is int else "a number",
                              f"E.g. auto:{key}={getattr(AutoConfig(), key)}.") from None
    return AutoConfig(**kwargs)


def _split_top(rest: str) -> list[str]:
    """Split ``a=1,candidates=none|topk:ratio=0.01,b=2`` on the commas between auto's own keys."""
    names = {f.name for f in dataclasses.fields(AutoConfig)}
    items: list[str] = []
    for piece in (p for p in rest.split(",") if p.strip()):
        if items and piece.partition("=")[0].strip() not in names:
            items[-1] += "," + piece
        else:
            items.append(piece)
    return items


class AutoPolicy(Policy):
    """Per-bucket codec choice from measurements (see the module docstring)."""

    @classmethod
    def from_spec(cls, spec: str) -> "AutoPolicy":
        return cls(parse_auto_spec(spec))

    def __init__(self, config: AutoConfig | None = None) -> None:
        self.config = config or AutoConfig()
        self.codecs: dict[str, Codec] = {c: parse_codec_spec(c) for c in self.config.candidates}
        self.choices: dict[int, str] = {}
        self.numels: dict[int, int] = {}
        self.banned: dict[int, set[str]] = {}   # by the accuracy guard, for good
        self.tried: dict[int, dict[str, float]] = {}  # trials the clock rejected -> link rate then
        self.trial: dict | None = None          # the plans of the current trial and their timed steps
        self.decisions: list[dict] = []
        self.costs: dict[str, Any] | None = None
        self.last_shadow: dict[int, dict[str, float]] = {}
        self.decided_bps: float | None = None
        self._last_step, self._state = -1, None
        self.step_times: list[float] = []  # first bucket to first bucket of the next step, less auto's own work
        self._step_t0: float | None = None
        self._aside = 0.0
        self.link = LinkMeter()
        self.compute = ComputeMeter()
        self.errors = ErrorMeter()
        self.shadow: dict[int, dict[str, float]] = {}  # bucket -> candidate -> its error with EF, in shadow
        self._shadow_residuals: dict[tuple[int, str], torch.Tensor] = {}
        self._shadow_qs: dict[tuple[int, str], dict] = {}     # PowerSGD shadows' warm-start Q per matrix
        self.shapes: dict[int, list[tuple]] = {}               # bucket -> its parameters' shapes
        self.lowrank_errors: dict[int, list[float]] = {}       # in-use PowerSGD's error, in shadow, this window
        self._lowrank_since: dict[int, tuple[str, int]] = {}   # bucket -> (PowerSGD spec, step it was chosen)

    # -- wiring ------------------------------------------------------------------------------------
    def bind(self, state, model: torch.nn.Module | None = None) -> None:
        """Start measuring: the hook's collectives, error feedback, and (given ``model``) its compute."""
        self._state = state
        self.link.wrap(state.wire)
        if state.feedback is not None:
            self.errors.wrap(state.feedback)
        if model is not None:
            self.compute.attach(model)

    # -- the Policy protocol -------------------------------------------------------------------------
    def codec_for(self, bucket: int, numel: int, step: int) -> Codec:
        if step != self._last_step:
            now = time.perf_counter()
            if step == self._last_step + 1 and self._step_t0 is not None:  # one whole step since the last
                self.step_times.append(now - self._step_t0 - self._aside)
            self._last_step, self._step_t0, self._aside = step, now, 0.0
            if self._state is not None and self._due(step):
                self._check(step)
                self._keep_needed_shadows(step)
                self._aside += time.perf_counter() - now  # auto's own work is not the plan's step time
        self.numels[bucket] = numel
        return self.codecs[self._plan(bucket)]

    def busy(self, bucket: int, step: int) -> bool:
        """Whether this bucket's ``observe`` or ``codec_for`` does heavy work (shadow runs in the
        warm-up or in PowerSGD's first window, a check at the step's first bucket): the hook then
        runs it on its communication thread, off the backward pass."""
        if step < self.config.warmup_steps or (step != self._last_step and self._due(step)):
            return True
        if bucket not in self._lowrank_since:
            return False
        spec, since = self._lowrank_since[bucket]
        return spec == self._plan(bucket) and step < since + self.config.check_every

    def observe(self, bucket: int, buf: torch.Tensor, step: int, shapes: list[tuple] | None = None) -> None:
        """The hook shows each bucket's gradient (and its parameters' shapes) before it travels.

        During the warm-up (every bucket sent with ``start``), every lossy candidate runs on it in shadow
        with an error feedback of its own: ``shadow[bucket][candidate]`` is the last step's
        ``||r|| / ||g + r_prev||``. PowerSGD runs per matrix with its warm-started ``Q``, as it is
        sent (:func:`~thinwire.compress.codecs.powersgd.local_approx`).

        After the warm-up, a bucket newly sent with PowerSGD keeps its shadow running for one
        window (``check_every`` steps), so the next check can ban it: the distributed scheme's
        residual cannot measure its error, because each rank's residual also holds its gradient's
        difference from the average (which the ranks' residuals cancel in the sum, as in PyTorch's
        hook) and so reads near 1 whatever the rank. After that window the shadow stops (it costs
        about as much as the codec itself); PowerSGD's error with a warm start falls as training
        settles, so the first window is the one that decides.
        """
        if shapes is not None:
            self.shapes[bucket] = [tuple(s) for s in shapes]
        if buf.numel() * 4 < 4096:
            return
        warm = step < self.config.warmup_steps
        current = self._plan(bucket)
        if not warm:
            spec, since = self._lowrank_since.get(bucket, ("none", -1))
            if spec != current or self.codecs[current].name != "powersgd" or bucket not in self.shapes:
                return
            if step >= since + self.config.check_every:
                self._shadow_residuals.pop((bucket, current), None)
                self._shadow_qs.pop((bucket, current), None)
                return
        self.numels.setdefault(bucket, buf.numel())
        t0 = time.perf_counter()
        x = buf.detach().float().flatten()
        errors = {}
        for spec, codec in self.codecs.items():
            if codec.lossless or (not warm and spec != current):
                continue
            errors[spec] = self._shadow_step(bucket, spec, codec, x)
        if warm:
            self.shadow[bucket] = errors
        else:
            self.lowrank_errors.setdefault(bucket, []).append(errors[current])
        self._aside += time.perf_counter() - t0  # not part of the plan's step time

    def _keep_needed_shadows(self, step: int) -> None:
        """After a decision only the shadows of buckets newly sent with PowerSGD go on (from their
        warm-up state, or fresh), for one window."""
        for bucket, spec in self.choices.items():
            if self.codecs[spec].name != "powersgd":
                self._lowrank_since.pop(bucket, None)  # sent with PowerSGD again later: a new first window
            elif self._lowrank_since.get(bucket, ("",))[0] != spec:
                self._lowrank_since[bucket] = (spec, step)
        for key in [k for k in self._shadow_residuals
                    if self.choices.get(k[0]) != k[1] or self.codecs[k[1]].name != "powersgd"]:
            del self._shadow_residuals[key]
            self._shadow_qs.pop(key, None)

    def _shadow_step(self, bucket: int, spec: str, codec: Codec, x: torch.Tensor) -> float:
        from thinwire.compress.codecs.powersgd import local_approx
        from thinwire.perf_profile.codecs import shadow_step

        key = (bucket, spec)
        previous = self._shadow_residuals.get(key)
        shapes = self.shapes.get(bucket)
        if codec.name != "powersgd" or shapes is None:
            self._shadow_residuals[key], error, _ = shadow_step(codec, x, previous)
            return error
        corrected = x + previous if previous is not None and previous.numel() == x.numel() else x.clone()
        residual = corrected - local_approx(corrected, shapes, codec.config, self._shadow_qs.setdefault(key, {}))
        self._shadow_residuals[key] = residual
        norm = float(corrected.norm())
        return float(residual.norm()) / norm if norm > 0 else 0.0

    def _plan(self, bucket: int) -> str:
        """The codec spec this bucket is sent with now: its choice, or ``start`` before the first."""
        return self.choices.get(bucket, self.config.start)

    def describe(self) -> str:
        if not self.choices:
            return "auto (measuring)"
        return "auto[" + ", ".join(f"{i}:{c}" for i, c in sorted(self.choices.items())) + "]"

    # -- measuring and deciding ----------------------------------------------------------------------
    def _due(self, step: int) -> bool:
        """The warm-up's end (the baseline window starts), then every ``check_every`` steps from the
        end of the baseline window; the same steps on every rank."""
        c = self.config
        first = c.warmup_steps + c.baseline_steps
        return (c.baseline_steps > 0 and step == c.warmup_steps) or (step >= first and (step - first) % c.check_every == 0)

    def _check(self, step: int) -> None:
        if self.costs is None:
            self.costs = self._codec_costs()
        if self.config.baseline_steps > 0 and step == self.config.warmup_steps:
            self.step_times = []  # the warm-up's steps (start-up, shadow runs) are no baseline
            return
        shared = self._agree()
        bps = 8 / shared["beta"]
        guard = self._guard(shared)
        if guard:  # accuracy first: no trial, no clock
            self.trial = None
            self._decide(step, shared, bps, guard, trial=False)
        elif self.trial is not None:
            self._verify(step, shared, bps)
        else:
            reason = self._reason(bps)
            if reason:
                self._decide(step, shared, bps, reason, trial=True)

    def _guard(self, shared: dict) -> str | None:
        for i, err in shared["errors"].items():
            current = self._plan(i)
            if err > self.config.max_error and current != "none":
                self.banned.setdefault(i, set()).add(current)
                return f"guard: bucket {i}'s error with error feedback {err:.3f} > cap {self.config.max_error} under {current}"
        return None

    def _reason(self, bps: float) -> str | None:
        if self.decided_bps is None:
            return "warm-up done"
        change = abs(bps - self.decided_bps) / self.decided_bps
        if change > self.config.rebalance_change:
            self._forget_rejections(bps)  # what the clock rejected may pay on this link
            return f"link moved {change:.0%}: {self.decided_bps / 1e6:.1f} -> {bps / 1e6:.1f} Mbit/s"
        return None

    def _forget_rejections(self, bps: float) -> None:
        """Let a rejected codec be tried again only if the link moved its way since it was rejected:
        slower for one that sends fewer bytes than the bucket's plan in use, faster for one that
        sends more."""
        for i, rejected in self.tried.items():
            current = self.codecs[self._plan(i)].payload_bytes(self.numels.get(i, 1 << 16))
            for spec, then in list(rejected.items()):
                stronger = self.codecs[spec].payload_bytes(self.numels.get(i, 1 << 16)) < current
                moved = bps / then - 1
                if moved < -self.config.rebalance_change if stronger else moved > self.config.rebalance_change:
                    del rejected[spec]

    def _verify(self, step: int, shared: dict, bps: float) -> None:
        """A window of a trial has ended: keep the new plan if its steps are surely faster than the
        old plan's, revert if they are not faster by ``keep_gain``, else time the other plan for a
        window and test again on all the steps so far (windows alternate, so a slow spell of the
        host falls on both); after ``trial_windows`` windows the medians decide."""
        c, t = self.config, self.trial
        t["steps"][t["arm"]] += shared["window"] or [shared["step_s"]]
        t["windows"] += 1
        new, old = t["steps"]["new"], t["steps"]["old"]
        now, before = statistics.median(new), statistics.median(old)
        p_value = _p_faster(new, old)
        faster = now <= before * (1 - c.keep_gain)
        measured = f"measured step {now * 1e3:.1f} ms vs {before * 1e3:.1f} ms before"
        if faster and p_value <= c.keep_p:
            keep, reason = True, f"kept: {measured}"
        elif not faster:
            keep, reason = False, f"reverted: {measured}, not {c.keep_gain:.0%} faster"
        elif t["windows"] >= c.trial_windows:
            keep, reason = True, f"kept: {measured} over {t['windows']} alternating windows (p = {p_value:.2f})"
        else:
            t["arm"] = "old" if t["arm"] == "new" else "new"
            previous, self.choices = self.choices, dict(t[t["arm"]])
            self._log_verdict(step, f"trial: {measured}, not surely faster yet (p = {p_value:.2f} > {c.keep_p}): "
                                    f"timing the {t['arm']} plan again", bps, now, before, previous)
            return
        self.trial = None
        previous, self.choices = self.choices, dict(t["new"] if keep else t["old"])
        if keep:
            self.decided_bps = bps
        else:
            for i, codec in t["new"].items():
                if t["old"].get(i) != codec:
                    self.tried.setdefault(i, {})[codec] = bps
        self._log_verdict(step, reason, bps, now, before, previous)

    def _log_verdict(self, step: int, reason: str, bps: float, now: float, before: float, previous: dict) -> None:
        self.decisions.append({"step": step, "reason": reason, "choices": dict(self.choices), "link_bps": bps,
                               "measured_step_s": now, "measured_before_s": before})
        changed = {i: c for i, c in self.choices.items() if previous.get(i, self.config.start) != c}
        log.info("auto at step %d (%s)%s", step, reason,
                 ": " + ", ".join(f"bucket {i} -> {c}" for i, c in sorted(changed.items())) if changed else "")

    def _decide(self, step: int, shared: dict, bps: float, reason: str, trial: bool) -> None:
        from thinwire.sim.inputs import codec_model

        order = sorted(self.numels)
        numels = [self.numels[i] for i in order]
        total = sum(numels) or 1
        buckets = [Bucket(numel=n, ready_frac=sum(numels[: k + 1]) / total) for k, n in enumerate(numels)]
        shapes = [self.shapes[i] for i in order] if all(i in self.shapes for i in order) else None
        models = {c: codec_model(c, None, numels={k: n for k, n in enumerate(numels)}, shapes=shapes)
                  for c in self.config.candidates}
        models = {c: dataclasses.replace(m, **self.costs_for(c)) for c, m in models.items()}
        p = self._state.wire.world
        banned = {order.index(i): set(b) for i, b in self.banned.items() if i in order}
        for i, b in self.tried.items():
            if i in order:
                banned.setdefault(order.index(i), set()).update(b)
        for i, errs in shared["shadow"].items():
            if i in order:
                banned.setdefault(order.index(i), set()).update(c for c, e in errs.items() if e > self.config.max_error)
        self.last_shadow = shared["shadow"]
        current = [self._plan(i) for i in order]  # a change must pay over it
        current = [c if c not in banned.get(k, ()) else "none" for k, c in enumerate(current)]
        decision = choose(initial=current, buckets=buckets, compute=Compute(pre_s=shared["pre_s"], backward_s=shared["backward_s"],
                                                           post_s=0.0),
                          speeds=[1.0] * p, network=Network(alpha_s=shared["alpha"], beta_s_per_byte=shared["beta"]),
                          candidates=models, banned=banned,
                          min_gain=self.config.min_gain, codec_steals_compute=_no_spare_core())
        old = dict(self.choices)
        self.choices = {i: c for i, c in zip(order, decision.choices)}
        self.decided_bps = bps
        if trial and any(old.get(i, self.config.start) != c for i, c in self.choices.items()):
            self.trial = {"old": {i: old.get(i, self.config.start) for i in self.choices}, "new": dict(self.choices),
                          "steps": {"old": list(shared["window"] or [shared["step_s"]]), "new": []}, "arm": "new",
                          "windows": 0}
        self._log(step, reason, decision, bps, old)

    def costs_for(self, spec: str) -> dict:
        from thinwire.perf.model import LinearCost

        if spec == "none" or not self.costs:
            return {}
        enc, dec = self.costs[spec]
        return {"encode": LinearCost(per_byte_s=enc), "decode": LinearCost(per_byte_s=dec)}

    def _log(self, step: int, reason: str, decision, bps: float, old: dict) -> None:
        entry = {"step": step, "reason": reason, "choices": dict(self.choices), "link_bps": bps,
                 "predicted_step_s": decision.step_s, "plan_in_use_step_s": decision.initial_s,
                 "uncompressed_step_s": decision.baseline_s,
                 "trial": self.trial is not None,
                 "shadow_errors": {i: {c: round(e, 4) for c, e in errs.items()} for i, errs in self.last_shadow.items()}}
        self.decisions.append(entry)
        changed = {i: c for i, c in self.choices.items() if old.get(i) != c}
        log.info("auto at step %d (%s): %s; predicted step %.1f ms vs %.1f ms with the plan in use, %.1f ms "
                 "uncompressed, link %.1f Mbit/s",
                 step, reason, ", ".join(f"bucket {i} -> {c}" for i, c in sorted(changed.items())) or "no change",
                 decision.step_s * 1e3, decision.initial_s * 1e3, decision.baseline_s * 1e3, bps / 1e6)

    # -- agreement across ranks ---------------------------------------------------------------------
    def _codec_costs(self) -> dict[str, tuple[float, float]]:
        """This rank's encode/decode seconds per byte of each lossy candidate, at the largest bucket."""
        from thinwire.perf_profile.codecs import measure_codec

        n = max(self.numels.values(), default=1 << 16)
        out = {}
        for spec in self.config.candidates:
            if spec != "none":
                c = measure_codec(spec, [n], reps=3)
                out[spec] = (c.encode.per_byte_s, c.decode.per_byte_s)
        return out

    def _agree(self) -> dict:
        """Merge the ranks' measurements with one MAX all-reduce (negated entries give a MIN)."""
        alpha, beta = self.link.estimate(self._state.wire.world)
        pre, backward = self.compute.estimate()
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        n = self.config.check_every  # the window's step times, padded to one length on every rank
        window = (self.step_times[-n:] + [-1.0] * n)[:n]
        self.step_times = []
        keys = sorted(self.numels)
        errs = self.errors.window_errors([str(i) for i in keys])
        lowrank, self.lowrank_errors = self.lowrank_errors, {}
        sent_lowrank = {i for i in keys if self.codecs[self._plan(i)].name == "powersgd"}
        errs = [statistics.fmean(lowrank[i]) if lowrank.get(i) else 0.0 if i in sent_lowrank else e
                for i, e in zip(keys, errs)]  # PowerSGD's residual does not measure its error (observe)
        specs = [s for s in self.config.candidates if s != "none"]
        lossy = [s for s in specs if not self.codecs[s].lossless]
        shadow = [self.shadow.get(i, {}).get(s, 0.0) for i in keys for s in lossy]
        local = [alpha, -beta, pre, backward, step_s, *[v for s in specs for v in self.costs[s]], *errs, *shadow,
                 *window]
        t = torch.tensor(local, dtype=torch.float64)
        if self._state.wire.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._state.wire.group)
        v = t.tolist()
        k = 5 + 2 * len(specs)
        self.costs = {s: (v[5 + 2 * j], v[6 + 2 * j]) for j, s in enumerate(specs)}
        errors = v[k:k + len(keys)]
        flat, window = v[k + len(keys):len(v) - n], v[len(v) - n:]
        shadow = {i: dict(zip(lossy, flat[j * len(lossy):(j + 1) * len(lossy)])) for j, i in enumerate(keys)}
        return {"alpha": v[0], "beta": -v[1], "pre_s": v[2], "backward_s": v[3], "step_s": v[4],
                "errors": dict(zip(keys, errors)), "shadow": shadow, "window": [w for w in window if w >= 0]}


def _p_faster(now: list[float], before: list[float]) -> float:
    """One-sided Mann-Whitney U p-value that step times ``now`` are faster than ``before``; 0.0 when
    either window has fewer than 3 steps (too few to test: the median rule alone decides).

    The normal approximation with continuity and tie corrections, as ``scipy.stats.mannwhitneyu(now,
    before, alternative="less", method="asymptotic")`` computes it (a test checks they agree).
    Written out because importing ``scipy.stats`` takes 0.8 s of CPU (measured on one idle core of
    this project's 2-core VM), which every process would pay at its first verdict, mid-training, while
    the other ranks wait for it."""
    n1, n2 = len(now), len(before)
    if n1 < 3 or n2 < 3:
        return 0.0
    ranks = _ranks([*now, *before])
    u = n1 * n2 - (sum(ranks[:n1]) - n1 * (n1 + 1) / 2)  # the U of ``before``: large when ``now`` is fast
    n = n1 + n2
    ties = sum(t ** 3 - t for t in collections.Counter([*now, *before]).values())
    sd = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sd == 0:
        return 1.0
    z = (u - n1 * n2 / 2 - 0.5) / sd
    return 0.5 * math.erfc(z / math.sqrt(2))


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _no_spare_core() -> bool:
    """The training threads use every core: codec work on the communication thread slows backward."""
    return torch.get_num_threads() >= (os.cpu_count() or 1)
