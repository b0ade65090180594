"""``AutoPolicy``: measure, agree, guard, decide, and keep a change only if the clock agrees.

The steps are described in :mod:`thinwire.auto`; this module wires its parts to the hook.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable

import torch

from thinwire.auto import decide as deciding
from thinwire.auto.agree import Measurements, agree_async
from thinwire.auto.meters import ComputeMeter, ErrorMeter, LinkMeter
from thinwire.auto.shadow import ShadowRuns
from thinwire.auto.spec import AutoConfig, parse_auto_spec
from thinwire.auto.trial import Trial, forget_rejections
from thinwire.compress.codecs import Codec
from thinwire.compress.hook import Policy
from thinwire.compress.schemes.switched import base_spec
from thinwire.compress.spec import parse_codec_spec

log = logging.getLogger("thinwire.plan")

EARLY_STEPS = 4  # a trial's first steps get an early look: reverted at once if surely slower (Trial.surely_slower)


class AutoPolicy(Policy):
    """Per-bucket codec choice from measurements (see :mod:`thinwire.auto`)."""

    @classmethod
    def from_spec(cls, spec: str) -> "AutoPolicy":
        return cls(parse_auto_spec(spec))

    def __init__(self, config: AutoConfig | None = None) -> None:
        config = config or AutoConfig()
        self.excluded = config.excluded()  # the convergence guard's "does not reach": never tried
        if self.excluded:
            keep = tuple(c for c in config.candidates if c not in self.excluded)
            config = dataclasses.replace(config, candidates=keep, start=config.start if config.start in keep else "none")
            log.info("auto: the convergence guard (%s) leaves out %s (does not reach fp32's loss at equal samples)",
                     config.guard, ", ".join(sorted(self.excluded)))
        self.config = config
        self.trusted = config.trusted()    # the guard's "reaches": not held to max_error
        self.codecs: dict[str, Codec] = {c: parse_codec_spec(c) for c in self.config.candidates}
        self.choices: dict[int, str] = {}
        self.numels: dict[int, int] = {}
        self.banned: dict[int, set[str]] = {}         # by the accuracy guard, for good
        self.tried: dict[int, dict[str, float]] = {}  # trials the clock rejected -> link rate then
        self.trial: Trial | None = None
        self.decisions: list[dict] = []
        self.costs: dict[str, tuple[float, float]] | None = None
        self.last_shadow: dict[int, dict[str, float]] = {}
        self.decided_bps: float | None = None
        self.step_times: list[float] = []  # first bucket to first bucket of the next step, less auto's own work
        self._last_step, self._state, self._step_t0, self._aside = -1, None, None, 0.0
        self._pending = None  # the agreement issued at the last check, concluded at the next step
        self._measurement: tuple[int, Measurements] | None = None  # (step, a check's measurements), to agree on
        self._moved: bool | None = None  # the last check saw the link moved past rebalance_change: faster?
        self._early_at: int | None = None  # the step of a trial's early look (EARLY_STEPS after it began)
        self._early = False                # the agreement in flight is that early look's
        self._switch_timed = True          # the last decision priced the switch at its timed pace (or had none)
        self.origin: int | None = None    # the hook's step at which this policy started: its warm-up and checks count from it
        self._resumed: str | None = None  # why a resumed run decides again at its first check (load_state_dict)
        self._resumed_at: int | None = None  # a resumed run's first step (-1: resumed, not yet stepped)
        self.link, self.compute, self.errors = LinkMeter(), ComputeMeter(), ErrorMeter()
        self.shadows = ShadowRuns(self.codecs, window=self.config.check_every)

    # -- the Policy hooks ----------------------------------------------------------------------------
    def bind(self, state, model: torch.nn.Module | None = None) -> None:
        """Start measuring: the hook's collectives, error feedback, and (given ``model``) its compute."""
        self._state = state
        self.link.wrap(state.wire)
        if state.feedback is not None:
            self.errors.wrap(state.feedback)
        if model is not None:
            self.compute.attach(model)

    def codec_for(self, bucket: int, numel: int, step: int) -> Codec:
        self._start(step)
        if step != self._last_step:
            now = time.perf_counter()
            if step == self._last_step + 1 and self._step_t0 is not None:  # one whole step since the last
                self.step_times.append(now - self._step_t0 - self._aside)
            self._last_step, self._step_t0, self._aside = step, now, 0.0
            if self._state is not None and (self._pending is not None or self._due(step)):
                if self._pending is not None:
                    self._conclude(step)
                if self._due(step):
                    self._check(step)
                self.shadows.keep_needed({i: base_spec(c) for i, c in self.choices.items()}, step)
                self._aside += time.perf_counter() - now  # auto's own work is not the plan's step time
        self.numels[bucket] = numel
        return self.codecs[self._codec(bucket)]

    def via_switch(self, bucket: int) -> bool:
        """Whether this bucket's plan is a codec through the switch (``int8@switch``, :mod:`.decide`)."""
        return self._plan(bucket) != self._codec(bucket)

    def busy(self, bucket: int, step: int) -> bool:
        """Shadow runs (the warm-up, a low-rank codec's first window), timing the codecs (the first
        check) and deciding (the step after a check) are heavy: the hook runs them on its
        communication thread, off the backward pass. A check itself only issues its agreement."""
        if self._start(step) < self.config.warmup_steps:
            return True
        if step != self._last_step and ((self.costs is None and self._due(step)) or self._deciding()):
            return True
        return self.shadows.in_first_window(bucket, self._codec(bucket), step)

    def sent(self, bucket: int, step: int) -> None:
        """The step's first bucket is on its way: a check's agreement goes out now, behind it (ahead of
        it, it held the gradient back by a small all-reduce's round trip), and is waited for at the
        next step."""
        if self._measurement is not None and self._measurement[0] == step:
            self._pending, self._measurement = self._agree(self._measurement[1]), None

    def observe(self, bucket: int, buf: torch.Tensor, step: int, shapes: list[tuple] | None = None) -> None:
        """Run the bucket's shadows (:class:`~thinwire.auto.shadow.ShadowRuns`) on its gradient."""
        if shapes is not None:
            self.shadows.shapes[bucket] = [tuple(s) for s in shapes]
        warm, current = self._start(step) < self.config.warmup_steps, self._codec(bucket)
        if buf.numel() * 4 < 4096 or not self.shadows.wanted(bucket, step, current, warm):
            return
        self.numels.setdefault(bucket, buf.numel())
        t0 = time.perf_counter()
        self.shadows.run(bucket, buf, warm=warm, current=current)
        self._aside += time.perf_counter() - t0  # not part of the plan's step time

    def describe(self) -> str:
        if not self.choices:
            return "auto (measuring)"
        return "auto[" + ", ".join(f"{i}:{c}" for i, c in sorted(self.choices.items())) + "]"

    def state_dict(self) -> dict:
        """What a resumed run goes on from (plain values, the same on every rank, as every decision is): the
        plan, what the accuracy guard banned and the clock rejected, the link rate it was decided at, the codec
        costs, the warm-up's shadow errors and the decisions so far. A trial in flight is not kept: the run
        resumes on the plan before it and decides again at its first check. Before the first decision there
        is nothing to keep: a run resumed then measures from a warm-up of its own (:meth:`_start`)."""
        if self.decided_bps is None and self.trial is None:
            return {}
        plan = self.trial.old if self.trial is not None else self.choices
        return {"kind": "auto", "candidates": list(self.config.candidates), "origin": self.origin,
                "numels": dict(self.numels), "choices": dict(plan),
                "banned": {i: sorted(specs) for i, specs in self.banned.items()},
                "tried": {i: dict(rates) for i, rates in self.tried.items()},
                "decided_bps": None if self.trial is not None else self.decided_bps,
                "costs": {spec: list(cost) for spec, cost in (self.costs or {}).items()},
                "shadow_errors": {i: dict(errors) for i, errors in self.shadows.errors.items()},
                "shapes": {i: [list(shape) for shape in shapes] for i, shapes in self.shadows.shapes.items()},
                "since": {i: list(v) for i, v in self.shadows.since.items()},
                "switch_timed": self._switch_timed, "decisions": list(self.decisions)}

    def load_state_dict(self, sd: dict) -> None:
        """Go on from a checkpoint's :meth:`state_dict`: the same plan from the first step, checks on the same
        steps, no warm-up. Made with other candidates, it is set aside and the run decides afresh."""
        if not sd:
            return
        if sd.get("kind") != "auto" or sd.get("candidates") != list(self.config.candidates):
            log.warning("auto: the checkpoint's plan was made with the candidates %s, this run has %s: measuring "
                        "and deciding again from a warm-up", "|".join(sd.get("candidates") or []),
                        "|".join(self.config.candidates))
            return
        self.origin, self.numels = sd["origin"], {int(i): int(n) for i, n in sd["numels"].items()}
        self.choices = {int(i): str(c) for i, c in sd["choices"].items()}
        self.banned = {int(i): set(specs) for i, specs in sd["banned"].items()}
        self.tried = {int(i): dict(rates) for i, rates in sd["tried"].items()}
        self.decided_bps = sd["decided_bps"]
        self.costs = {spec: tuple(cost) for spec, cost in sd["costs"].items()} or None
        self.shadows.errors = {int(i): dict(errors) for i, errors in sd["shadow_errors"].items()}
        self.shadows.shapes = {int(i): [tuple(shape) for shape in shapes] for i, shapes in sd["shapes"].items()}
        self.shadows.since = {int(i): (str(v[0]), int(v[1])) for i, v in sd["since"].items()}
        self._switch_timed, self.decisions = bool(sd["switch_timed"]), list(sd["decisions"])
        self._resumed_at = -1
        if self.decided_bps is None:
            self._resumed = "resumed from a checkpoint taken during a trial"
        if not self._switch() and any(base_spec(c) != c for c in self.choices.values()):
            # restarted on the ring (the aggregator gone): those buckets go around it, and the plan is decided again
            self.choices = {i: base_spec(c) for i, c in self.choices.items()}
            self.decided_bps, self._resumed = None, "resumed without the switch its plan sent through"
        log.info("auto: resumed on its plan %s", self.describe())

    # -- measuring and deciding ----------------------------------------------------------------------
    def _plan(self, bucket: int) -> str:
        """The candidate this bucket is sent with now: its choice, or ``start`` before the first."""
        return self.choices.get(bucket, self.config.start)

    def _codec(self, bucket: int) -> str:
        """The codec spec of this bucket's plan, by either route (``int8@switch`` -> ``int8``)."""
        return base_spec(self._plan(bucket))

    def _switch(self) -> bool:
        """Whether the job has an aggregator on the switch (a port the trainer sets after ``attach``)."""
        return getattr(self._state, "switch", None) is not None

    def _due(self, step: int) -> bool:
        """The warm-up's end (the baseline window starts), then every ``check_every`` steps from the
        end of the baseline window, and a trial's early look; the same steps on every rank."""
        return self._regular(step) or (self.trial is not None and step == self._early_at)

    def _start(self, step: int) -> int:
        """Steps since this policy started (its first step seen: 0 in a new run, the checkpoint's step when
        a run resumed without auto's state, which then measures and decides again from its warm-up)."""
        if self.origin is None:
            self.origin = step
        if self._resumed_at == -1:
            self._resumed_at = step
        return step - self.origin

    def _regular(self, step: int) -> bool:
        c = self.config
        if self._resumed_at is not None and step < self._resumed_at + max(1, c.baseline_steps):
            return False  # resumed: the meters start empty, and a check needs a window of this run's steps
        step -= self.origin or 0
        first = c.warmup_steps + c.baseline_steps
        return (c.baseline_steps > 0 and step == c.warmup_steps) or (step >= first and (step - first) % c.check_every == 0)

    def _check(self, step: int) -> None:
        """Measure the window that ends here and issue its agreement; :meth:`_conclude` acts on it."""
        self.link.wrap_switch(getattr(self._state, "switch", None))  # its exchanges timed from now on
        if self.costs is None:  # timed in the warm-up's shadows; the rest (low-rank, unshadowed) here
            timed = self.shadows.costs()
            rest = tuple(c for c in self.config.candidates if c not in timed)
            self.costs = {**deciding.codec_costs(rest, max(self.numels.values(), default=1 << 16)), **timed}
        if self.config.baseline_steps > 0 and step - (self.origin or 0) == self.config.warmup_steps:
            self.step_times = []  # the warm-up's steps (start-up, shadow runs) are no baseline
            return
        self._early = step == self._early_at
        self._measurement = (step, self._measured())  # its agreement goes out behind this step's first bucket

    def _deciding(self) -> bool:
        """Whether the next conclusion may run the planner's search (the first decision, a trial's
        verdict or a re-decision): every rank answers the same, from agreed state alone."""
        return self._pending is not None and (self.decided_bps is None or self.trial is not None)

    def _conclude(self, step: int) -> None:
        """The agreement of the last check has arrived (every rank the same record): guard, judge a
        trial, or re-decide. A changed plan applies from this step; its window starts here."""
        shared, self._pending = self._pending(), None
        self.costs = shared.costs
        before, codecs = dict(self.choices), {i: self._codec(i) for i in self.numels}
        self._act(step, shared)
        self._early = False
        if self.choices != before:
            self.step_times = []  # the step that just ended ran the old plan
            # and its buckets' errors are the old codecs': not to be held against the new ones at the next check
            self.errors.forget([str(i) for i, codec in codecs.items() if self._codec(i) != codec])

    def _act(self, step: int, shared: Measurements) -> None:
        bps = 8 / shared.beta
        guard = self._guard(shared)
        if guard:  # accuracy first: no trial, no clock
            self.trial = None
            self._decide(step, shared, bps, guard, trial=False)
        elif self.trial is not None:
            self._verify(step, shared, bps)
        elif reason := self._reason(bps, shared):
            self._decide(step, shared, bps, reason, trial=True)

    def _guard(self, shared: Measurements) -> str | None:
        for i, err in shared.errors.items():
            current = self._codec(i)  # banned by either route (decide._left_out)
            if err > self.config.max_error and current != "none" and current not in self.trusted:
                self.banned.setdefault(i, set()).add(current)
                return f"guard: bucket {i}'s error with error feedback {err:.3f} > cap {self.config.max_error} under {current}"
        return None

    def _reason(self, bps: float, shared: Measurements) -> str | None:
        """Why to decide again, or None. A move of the link rate counts once two checks in a row see
        it, the same way: on a CPU-bound host one window's reading can move 30-45% and back (a window
        of collectives that waited for a busy core), and each re-decision may cost a trial. The switch's
        pace, timed for the first time since a decision priced it from the link's, counts at once."""
        if self.decided_bps is None:
            return self._resumed or "warm-up done"
        if not self._switch_timed and shared.switch_beta is not None:
            return (f"the switch timed: {8 / shared.switch_beta / 1e6:.1f} Mbit/s per trainer, aggregator included, "
                    f"where it was priced at the link's {bps / 1e6:.1f}")
        change = abs(bps - self.decided_bps) / self.decided_bps
        moved = None if change <= self.config.rebalance_change else bps > self.decided_bps
        seen, self._moved = self._moved, moved
        if moved is None or seen != moved:
            return None
        self._moved = None
        self._forget_rejections(bps)  # what the clock rejected may pay on this link
        return f"link moved {change:.0%}: {self.decided_bps / 1e6:.1f} -> {bps / 1e6:.1f} Mbit/s"

    def _forget_rejections(self, bps: float) -> None:
        forget_rejections(self.tried, bps, self.config.rebalance_change, plan=self._plan,
                          bytes_of=lambda i, spec: self.codecs[base_spec(spec)].payload_bytes(self.numels.get(i, 1 << 16)))

    def _verify(self, step: int, shared: Measurements, bps: float) -> None:
        """A window of the trial has ended: keep, revert, or time the other plan again."""
        cfg = self.config
        window = shared.window or [shared.step_s]
        if self._early:  # the trial's first steps: reverted now if surely slower, else its window goes on
            verdict = self.trial.surely_slower(window, keep_p=cfg.keep_p)
            if verdict is None:
                return
        else:
            verdict = self.trial.judge(window, keep_gain=cfg.keep_gain, keep_p=cfg.keep_p, trial_windows=cfg.trial_windows)
        if verdict.outcome == "keep":
            self.decided_bps = bps
        elif verdict.outcome == "revert":
            for i, codec in self.trial.changed().items():
                self.tried.setdefault(i, {})[codec] = bps
        if verdict.outcome != "again":
            self.trial = None
        previous, self.choices = self.choices, verdict.plan
        self.decisions.append({"step": step, "reason": verdict.reason, "choices": dict(self.choices), "link_bps": bps,
                               "measured_step_s": verdict.now, "measured_before_s": verdict.before})
        changed = ", ".join(f"bucket {i} -> {c}" for i, c in sorted(self.choices.items())
                            if previous.get(i, cfg.start) != c)
        log.info("auto at step %d (%s)%s", step, verdict.reason, ": " + changed if changed else "")

    def _decide(self, step: int, shared: Measurements, bps: float, reason: str, trial: bool) -> None:
        guards = deciding.Guards(banned=self.banned, tried=self.tried, max_error=self.config.max_error,
                                 trusted=frozenset(self.trusted))
        self.last_shadow = shared.shadow
        old = dict(self.choices)
        self.choices, decision = deciding.decide(
            numels=self.numels, shapes=self.shadows.shapes, plan={i: self._plan(i) for i in self.numels},
            candidates=self.config.candidates, costs=self.costs or {}, shared=shared, guards=guards,
            world=self._state.wire.world, min_gain=self.config.min_gain, switch=self._switch())
        self.decided_bps, self._moved = bps, None
        self._switch_timed = shared.switch_beta is not None or not self._switch()
        start = self.config.start
        if trial and any(old.get(i, start) != c for i, c in self.choices.items()):
            self.trial = Trial(old={i: old.get(i, start) for i in self.choices}, new=dict(self.choices),
                               steps={"old": list(shared.window or [shared.step_s]), "new": []})
            # its first steps get an early look, unless a regular check comes as soon
            early = step + EARLY_STEPS
            self._early_at = None if any(self._regular(s) for s in range(step + 1, early + 1)) else early
        self.decisions.append(deciding.record(step, reason, old=old, choices=self.choices, bps=bps, decision=decision,
                                              trial=self.trial is not None, shadow=self.last_shadow))

    # -- agreement across ranks ---------------------------------------------------------------------
    def _agree(self, measured: Measurements) -> Callable[[], Measurements]:
        """This rank's measurements over the window, their merge with every rank's issued
        (:func:`thinwire.auto.agree.agree_async`): call the result for the merged record."""
        return agree_async(measured, window=self.config.check_every, group=self._state.wire.group,
                           world=self._state.wire.world)

    def _measured(self) -> Measurements:
        alpha, beta = self.link.estimate(self._state.wire.world)
        pre, backward = self.compute.estimate()
        window, self.step_times = self.step_times, []
        keys = sorted(self.numels)
        errors = dict(zip(keys, self.errors.window_errors([str(i) for i in keys])))
        lossy = [s for s in self.config.candidates if s != "none" and not self.codecs[s].lossless]
        return Measurements(alpha=alpha, beta=beta, pre_s=pre, backward_s=backward,
                            step_s=statistics.median(window) if window else 0.0,
                            errors=self.shadows.in_use_errors(errors, self._codec),
                            shadow=self.shadows.warmup_errors(keys, lossy), window=window,
                            costs={s: self.costs[s] for s in self.config.candidates if s != "none"},
                            switch_beta=self.link.switch_estimate())
