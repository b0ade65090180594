"""``auto[:trial=N,warmup=W,guard=P]``: ``allreduce`` or ``delayed``, whichever steps faster on this run's clock.

Whether one-step-stale averaging pays depends on what the model cannot see well: how much of the
all-reduce DDP already hides behind backward, and what the communication thread takes from compute
on a host without a spare core. So the run measures both:

1. ``warmup`` steps (10) of ``allreduce``, not timed (start-up: allocator, DDP's bucket rebuild);
2. ``trial`` steps (20) of ``allreduce``, timed;
3. ``trial`` steps of ``delayed``, timed from its third step (the first applies nothing, the pipeline
   fill; the second still waits on the first's average);
4. the choice, by the median wall-clock time of a step (from one optimizer step's end to the next's (everything a step
   end: data, forward, backward, waits), each rank's median averaged over the ranks (one small
   all-reduce, so every rank makes the same choice): ``delayed`` only when it is at least ``MARGIN`` (2%)
   faster, since a stale gradient is not free in loss (the guard's ``delayed`` factor in a profile
   measures that cost); then that mode for the rest of the run.

With ``guard=P`` (a profile of the workload from ``thinwire profile``) whose convergence guard says
``delayed`` does not reach fp32's loss at equal samples, the run stays on ``allreduce`` from its first
step and times nothing: a faster step is no use if the run needs more of them than it saves (on charlm
with AdamW: +47% final loss at 480 steps, ``benchmarks/results/guard_eval.md``).

Both modes average through one :class:`~thinwire.compress.hook.CommState` (one codec, one byte
count; ``delayed``'s error-feedback residuals under keys of their own) in a process group of its
own. Switching back from ``delayed`` drops the one average still in flight (as its pipeline fill
skips one at the start). The choice, and the two medians, are in the checkpoint and the run's
summary; a run resumed before the choice measures again from where it resumed.
"""

from __future__ import annotations

import statistics
import time

import torch

from thinwire.compress.sync.base import StepParts, SyncMode
from thinwire.compress.sync.delayed import Delayed

MARGIN = 0.02          # delayed must be this much faster (median step) to be chosen
DELAYED_SETTLE = 2     # delayed's first timed intervals: its pipeline fill
KEY_OFFSET = 1 << 20   # delayed's residual keys, apart from the DDP hook's bucket indices


class ChooseSync(SyncMode):
    name = "auto"
    state_keys = ("steps", "choice", "agreed", "times", "delayed")
    buffers_diverge = True  # once it runs delayed (forward under no_sync), as Delayed's

    def __init__(self, model, comm, spec, *, bucket_mb: float = 25.0) -> None:
        super().__init__(model, comm, spec)
        self.delayed = Delayed(model, comm, spec, bucket_mb=bucket_mb)
        self.delayed.optimizer, self.delayed.clip = self.optimizer, self.clip
        self.delayed.key_offset = KEY_OFFSET
        self.delayed.active = False  # its weight prediction only while delayed runs
        self.warmup, self.trial = spec.warmup, spec.trial
        self.steps = 0
        self.times: dict[str, list[float]] = {"allreduce": [], "delayed": []}
        self.choice: str | None = None
        self.agreed: list[float] | None = None  # the ranks' mean medians (allreduce, delayed) the choice used
        self._last: float | None = None
        if not spec.try_delayed:  # the guard (auto:guard=P) says delayed does not reach fp32's loss: never tried
            self.choice, self.by_guard = "allreduce", True
        else:
            self.by_guard = False

    # the step's optimizer and clip reach delayed's weight prediction as soon as they are set (``thinwire.sync(...,
    # optimizer=)``, the trainer): a resumed run's first forward predicts with them, before any after_step
    @property
    def optimizer(self):
        return self.__dict__.get("_optimizer")

    @optimizer.setter
    def optimizer(self, value) -> None:
        self.__dict__["_optimizer"] = value
        if "delayed" in self.__dict__:
            self.delayed.optimizer = value

    @property
    def clip(self):
        return self.__dict__.get("_clip")

    @clip.setter
    def clip(self, value) -> None:
        self.__dict__["_clip"] = value
        if "delayed" in self.__dict__:
            self.delayed.clip = value

    @classmethod
    def step_s(cls, spec, parts: StepParts) -> float:
        """The one the run will choose: delayed only where its guard lets it be tried and it is ``MARGIN``
        faster (:func:`choose`)."""
        allreduce = SyncMode.step_s(spec, parts)
        if not getattr(spec, "try_delayed", True):
            return allreduce
        return min(allreduce, d) if (d := Delayed.step_s(spec, parts)) < allreduce * (1 - MARGIN) else allreduce

    @property
    def current(self) -> str:
        """The mode this step runs."""
        if self.choice is not None:
            return self.choice
        return "delayed" if self.steps >= self.warmup + self.trial else "allreduce"

    def no_sync(self):
        return self.delayed.no_sync() if self.current == "delayed" else super().no_sync()

    def before_step(self) -> None:
        if self.current == "delayed":
            self.delayed.before_step()

    def after_step(self) -> None:
        now, step = time.perf_counter(), self.steps  # the step that just ended: [the last after_step, now]
        if self.choice is None and self._last is not None:
            if self.warmup <= step < self.warmup + self.trial:
                self.times["allreduce"].append(now - self._last)
            elif step >= self.warmup + self.trial + DELAYED_SETTLE:
                self.times["delayed"].append(now - self._last)
        self._last = now
        self.steps += 1
        if self.choice is None and self.steps >= self.warmup + 2 * self.trial:
            self.delayed.flush()  # nothing in flight in the group while the ranks agree
            medians = torch.tensor([statistics.median(self.times[k]) for k in ("allreduce", "delayed")],
                                   dtype=torch.float64)
            wire = self.comm.wire
            wire.all_reduce(medians)  # every rank's clock, averaged: one choice for all
            self.agreed = (medians / wire.world).tolist()
            self.choice = decide({"allreduce": [self.agreed[0]], "delayed": [self.agreed[1]]})
            if self.choice == "allreduce":  # the last stale average: waited for, not applied
                self.delayed.pending, self.delayed.started = [], False
        self.delayed.active = self.current == "delayed"  # its weight prediction only while it runs

    def flush(self) -> None:
        self.delayed.flush()

    def stats(self) -> dict:
        a, d = self.agreed or (None, None)
        return {"choice": self.choice, "allreduce_median_step_s": a, "delayed_median_step_s": d,
                **({"chosen_by": "the guard: delayed does not reach fp32's loss"} if self.by_guard else {})}

    def state_dict(self) -> dict:
        return {**self.saved_by(), "steps": self.steps, "choice": self.choice, "agreed": self.agreed,
                "times": {k: list(v) for k, v in self.times.items()}, "delayed": self.delayed.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.check_state(sd)
        self.steps = int(sd.get("steps", 0))
        self.choice, self.agreed = sd.get("choice"), sd.get("agreed")
        self.delayed.load_state_dict(sd.get("delayed", {}))
        if self.by_guard:  # the guard's verdict holds whatever the checkpoint was taken under
            self.choice = "allreduce"
        if self.choice is None:  # resumed before the choice: measure again from here
            self.warmup, self._last = self.steps + self.spec.warmup, None
            self.times = {"allreduce": [], "delayed": []}
            self.delayed.pending, self.delayed.started, self.delayed.held, self.delayed.own = [], False, None, None
        self.delayed.active = self.current == "delayed"
        self._own_buffers_on_resume()


def decide(times: dict[str, list[float]]) -> str:
    """``delayed`` when its median step is at least ``MARGIN`` below ``allreduce``'s.

    >>> decide({"allreduce": [1.0, 1.0, 1.1], "delayed": [0.9, 0.95, 0.9]})
    'delayed'
    >>> decide({"allreduce": [1.0, 1.0], "delayed": [0.99, 0.99]})
    'allreduce'
    """
    a, d = statistics.median(times["allreduce"]), statistics.median(times["delayed"])
    return "delayed" if d < a * (1 - MARGIN) else "allreduce"
