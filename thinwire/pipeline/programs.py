"""The programs ``torch.distributed.pipelining``'s multi-stage schedules run, written out for the model.

:func:`thinwire.perf.pipeline.simulate_schedule` plays each rank's program out operation by operation; for
GPipe and 1F1B it writes them itself (:func:`thinwire.perf.pipeline.stage_program`), for the interleaved
schedule it is handed them from here: torch computes each rank's order of forwards and backwards
(``ScheduleInterleaved1F1B._calculate_single_rank_operations``) and lowers it to sends and receives
(``_add_send_recv``, which places a receive in the receiver's order where the sender computes), and its
runtime (``_PipelineScheduleRuntime._step_microbatches``) posts each send and receive where it stands, waits
for a receive right before the computation that needs it, and for the sends only at the step's end. The
same functions of the installed torch build the order here, so the model follows what the ranks run.
"""

from __future__ import annotations

import functools
import types

from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _add_send_recv


@functools.lru_cache(maxsize=64)  # the planner prices many splits of one layout: lowered once (22 ms at S=16, M=64)
def interleaved_programs(stages: int, virtual: int, microbatches: int) -> tuple[tuple[tuple, ...], ...]:
    """Each of the ``stages`` ranks' programs for ``ScheduleInterleaved1F1B`` with ``virtual`` stages per rank
    (stage k on rank ``k % stages``), in :func:`thinwire.perf.pipeline.simulate_schedule`'s form: ``("post",
    ops)``, ``("wait", ops)`` with ops ``("send"|"recv", "F"|"B", stage, micro-batch)``, and ``("F"|"B", (stage,
    micro-batch))``. Read-only: the tuples are shared between callers."""
    S, V, M = stages, virtual, microbatches
    rounds = max(1, M // S)
    me = types.SimpleNamespace(n_local_stages=V, pp_group_size=S, _n_microbatches=M, microbatches_per_round=M // rounds)
    compute = {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(me, r) for r in range(S)}
    lowered = _add_send_recv(compute, stage_to_rank=lambda k: k % S, num_stages=S * V)
    last = S * V - 1
    programs = []
    for r in range(S):
        prog: list[tuple] = []
        sends: list[tuple] = []
        for a in lowered[r]:
            kind, k, m = str(a.computation_type.value), a.stage_index, a.microbatch_index
            if kind == "F":
                if k > 0 and (k - 1) % S != r:
                    prog.append(("wait", (("recv", "F", k, m),)))
                prog.append(("F", (k, m)))
            elif kind == "B":
                if k < last and (k + 1) % S != r:
                    prog.append(("wait", (("recv", "B", k, m),)))
                prog.append(("B", (k, m)))
            elif kind in ("SEND_F", "SEND_B"):
                op = ("send", kind[-1], k, m)
                prog.append(("post", (op,)))
                sends.append(op)
            elif kind in ("RECV_F", "RECV_B"):
                prog.append(("post", (("recv", kind[-1], k, m),)))
            else:
                raise AssertionError(f"interleaved 1F1B's program holds {a!r}, which the model does not know")
        prog.append(("wait", tuple(sends)))
        programs.append(tuple(prog))
    return tuple(programs)
