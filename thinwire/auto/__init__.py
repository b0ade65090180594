"""``auto``: an online plan that picks each bucket's codec from measured link, compute and codec costs.

A :class:`~thinwire.compress.hook.Policy` (:class:`AutoPolicy`); every rank answers identically.
Why each step and each default is what it is, with the runs that showed it: ``docs/auto.md``.

0. **Start light.** Until its first decision ``auto`` sends ``start``: bf16 where it is a candidate
   (the default), else none. bf16 halves fp32's bytes for one cast, with the smallest error of any
   codec; ``auto:start=none`` sends fp32 until the first decision.
1. **Measure, passively, on every rank** (:mod:`.meters`). Once bound to the hook's state and the
   model (:meth:`AutoPolicy.bind`), it times every collective the hook issues, the forward start and
   the first and last gradient of each backward (autograd hooks), and, through error feedback's
   ``update``, what each compressed bucket holds back.
2. **Agree** (:mod:`.agree`). After ``warmup_steps``, then ``baseline_steps`` more steps sent as at
   the start, and every ``check_every`` steps from then on, one all-reduce merges the ranks'
   measurements into one :class:`~thinwire.auto.agree.Measurements` record, the same on every rank.
   It is issued without waiting, behind the step's first bucket, and acted on at the next step.
3. **Decide** (:mod:`.decide`) with the performance model and the planner's per-bucket search: the
   candidate that minimizes the predicted step, per bucket. It decides after the baseline window,
   again when the measured link rate has moved by more than ``rebalance_change`` (30%) from the rate
   of the last decision at two checks in a row (one window's reading on a busy host can jump and come
   back), and when the accuracy guard bans a codec from a bucket. Where the job has an aggregator on the
   switch (``thinwire train --aggregation switch``), int8 is a candidate both around the ring and through
   the switch (``int8@switch``), the switch priced from the link until its exchanges are timed, then
   decided again once at the timed pace.
4. **Guard accuracy**, before and after. The guarded quantity is the relative compression error
   with error feedback, ``||r|| / ||g + r_prev||``, capped at ``max_error``
   (:data:`~thinwire.plan.choose.MAX_EF_ERROR`, 0.1, the planner's cap too). Before any codec is
   used, every lossy candidate runs in shadow on the warm-up's real gradients (:mod:`.shadow`); one
   above the cap is not considered for that bucket. Once used, the same quantity averaged over the
   window is checked at every check: above the cap the codec is banned from the bucket and the
   plan is re-decided. ``auto:max_error=0.5`` trades loss for speed (admits PowerSGD rank 8).
   With ``auto:guard=PROFILE`` (a profile of the same workload from ``thinwire profile``) the
   convergence guard decides instead, as it does for ``thinwire plan``: a candidate it says does not
   reach fp32's loss at equal samples is never tried, one it says reaches is not held to the cap, and
   a candidate it has no record for keeps the cap (:class:`~thinwire.auto.spec.AutoConfig`).
5. **Switch only for a real gain.** Every change of plan costs a trial and the model is good to a
   few percent, so a candidate must be predicted ``min_gain`` (10%) faster than the plan in use.
6. **Keep a switch only if the clock agrees** (:mod:`.trial`): the next window's median step (less
   ``auto``'s own work) must be ``keep_gain`` (5%) faster, and its steps faster by a one-sided
   Mann-Whitney U test at ``keep_p`` (0.05); else the plan is reverted, or, faster by the median but
   not surely, the two plans are timed in alternating windows for up to ``trial_windows`` (3).
   The trial's first ``EARLY_STEPS`` (4) steps get an early look: surely slower, it is reverted then.

7. **Resume where it was.** The hook's checkpoint state (``CommState.state_dict``) holds the plan, what the
   guards banned and the clock rejected, the codec costs, the warm-up's shadow errors and the decisions
   (:meth:`AutoPolicy.state_dict`); a resumed run goes on with them, its checks on the same steps. Without them
   (a checkpoint before the first decision, or other candidates) it starts over: warm-up and checks count
   from the first step it sees.

Costs: one all-reduce of a few hundred float64 values per check, off the step's critical path;
encode and decode of every lossy candidate per bucket in the warm-up (which also times them), and
one fp32 residual per candidate and bucket while its shadow runs; timing a low-rank codec once.
Every decision is logged (``thinwire.plan`` logger) with its reason and kept in ``decisions``.

Example::

    policy = AutoPolicy(AutoConfig(candidates=("none", "bf16", "topk:ratio=0.01")))
    state = thinwire.attach(ddp_model, policy)      # attach calls policy.bind(state, model)
    # or: thinwire.attach(ddp_model, "auto:max_error=0.3")
"""

from thinwire.auto.policy import AutoPolicy
from thinwire.auto.spec import AutoConfig, parse_auto_spec

__all__ = ["AutoConfig", "AutoPolicy", "parse_auto_spec"]
