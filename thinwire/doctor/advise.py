"""From what the ranks measured to one recommendation: every codec and sync mode priced by the
performance model, the model checked against the DDP fp32 step it can be compared with.

* **Speeds**: each rank's measured step without communication, against the profile's compute at the
  same per-rank batch (measured on rank 0 just before), is that rank's speed; the slowest sets the pace.
* **Network**: the measured all-reduce's alpha and beta (the ring's slowest edge, at the efficiency
  the wire really delivers).
* **Each codec**: :func:`thinwire.perf.model.predict_step` with the codec's own scheme and its costs
  measured on rank 0; its speed-up is the predicted DDP fp32 step over its predicted step (a ratio
  of two predictions, so an error the model makes on both cancels), and its step is the measured
  DDP fp32 step divided by that speed-up.
* **Sync modes**, each priced by the class that runs it (:meth:`SyncMode.step_s`) with the best codec.
  Their loss at equal samples is not predicted, so they are shown, never recommended.
* **The recommendation**: the codec with the largest predicted speed-up, when it is at least
  :data:`WORTH` (5%); otherwise "keep DDP fp32", said plainly. Lossy codecs change the loss at equal
  samples: the recommendation says how to check that (``thinwire profile`` runs the convergence guard
  and ``thinwire plan`` ranks by time to fp32's loss).
"""

from __future__ import annotations

import statistics

from thinwire.compress.spec import default_candidates
from thinwire.compress.sync import StepParts, kind
from thinwire.perf.model import Network, predict_step
from thinwire.sim.inputs import buckets_of, codec_model, compute_at
from thinwire.syncspec import SHOWN, parse_sync_spec

WORTH = 1.05          # a predicted speed-up below this is not worth a change
SLOW_HOST = 1.3       # a rank this much slower than the median rank is named
SLOW_LINK = 0.5       # a pair this much below the median pair's rate is named


def advise(*, ranks: list[dict], network: dict, pairs: list[dict], profile, per_rank_batch: int,
           steals: bool, workload: str, codecs: tuple[str, ...] | None = None) -> dict:
    codecs = codecs or default_candidates()
    p = len(ranks)
    floors = [r["floor_s"] for r in ranks]
    ddp = statistics.median(r["ddp_s"] for r in ranks)
    comm_share = max(0.0, 1 - max(floors) / ddp)
    comp = compute_at(profile, per_rank_batch)
    speeds = [comp.total_s / f for f in floors]
    net = Network(alpha_s=network["alpha_s"], beta_s_per_byte=network["beta_s_per_byte"])
    buckets = buckets_of(profile)
    preds = {c: predict_step(buckets=buckets, compute=comp, speeds=speeds, network=net,
                             codec=codec_model(c, profile), codec_steals_compute=steals) for c in codecs}
    base = preds["none"].step_s
    rows = []
    for c, pr in preds.items():
        speedup = base / pr.step_s
        rows.append({"codec": c, "predicted_step_s": ddp / speedup, "model_step_s": pr.step_s, "speedup": speedup,
                     "bytes_per_rank": pr.bytes_per_rank, "exposed_comm_s": pr.exposed_comm_s})
    rows.sort(key=lambda r: -r["speedup"])
    best = rows[0]
    pb = preds[best["codec"]]
    parts = StepParts(allreduce_step_s=pb.step_s, compute_s=pb.compute_s + pb.noise_s, comm_s=pb.comm_s,
                      codec_s=pb.codec_s, codec_steals_compute=steals)
    sync_rows = []
    for text in SHOWN:
        spec = parse_sync_spec(text)
        step = kind(spec).step_s(spec, parts)
        sync_rows.append({"sync": text, "codec": best["codec"], "speedup": base / step, "predicted_step_s": ddp * step / base})
    median_floor = statistics.median(floors)
    slow_hosts = [{"rank": i, "floor_s": f, "x_median": f / median_floor} for i, f in enumerate(floors)
                  if f > SLOW_HOST * median_floor]
    rates = [q["bps"] for q in pairs]
    slow_links = [] if not rates else [q for q in pairs if q["bps"] < SLOW_LINK * statistics.median(rates)]
    worth = best["codec"] != "none" and best["speedup"] >= WORTH
    report = {
        "workload": workload, "world_size": p, "per_rank_batch": per_rank_batch,
        "measured": {"ddp_fp32_step_s": ddp, "no_comm_step_s": max(floors), "comm_share": comm_share,
                     "per_rank": ranks, "allreduce": network, "pairs": pairs},
        "model": {"ddp_fp32_step_s": base, "error_vs_measured": base / ddp - 1, "speeds": speeds},
        "codecs": rows, "sync_modes": sync_rows, "slow_hosts": slow_hosts, "slow_links": slow_links,
        "recommendation": _recommend(worth, best, comm_share, workload),
    }
    return report


def _recommend(worth: bool, best: dict, comm_share: float, workload: str) -> dict:
    if not worth:
        return {"action": "keep", "codec": "none",
                "why": f"communication is {comm_share:.0%} of the step and no codec is predicted to make it more than "
                       f"{WORTH - 1:.0%} faster: nothing thinwire offers will help this job here; keep DDP fp32",
                "command": None}
    c = best["codec"]
    return {"action": "compress", "codec": c, "speedup": best["speedup"],
            "why": f"communication is {comm_share:.0%} of the step; {c} is predicted {best['speedup']:.2f}x faster per "
                   "step than DDP fp32. Its loss at equal samples is not measured here: `thinwire profile` runs the "
                   "convergence guard and `thinwire plan` ranks codecs by time to fp32's loss",
            "command": f"thinwire train --workload {workload} --compression {c}",
            "in_your_script": f'thinwire.attach(ddp_model, "{c}")'}
