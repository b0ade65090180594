"""From what the ranks measured to one recommendation: every codec and sync mode priced by the
performance model, the model checked against the DDP fp32 step it can be compared with.

* **Speeds**: each rank's measured step without communication, against the profile's compute at the
  same per-rank batch (measured on rank 0 just before), is that rank's speed; the slowest sets the pace.
* **Network**: the measured all-reduce's alpha and beta (the ring's slowest edge, at the efficiency
  the wire really delivers).
* **Each codec** is judged by its trial (:func:`.probe.codec_trials`: a few real steps with thinwire's
  hook and the codec): its speed-up is fp32's trial step over its own. The model's price of it is
  reported beside (``model_speedup``), and used where there was no trial (one rank):
  :func:`thinwire.perf.model.predict_step` with the codec's own scheme and its costs
  measured on rank 0, then **calibrated on the one step doctor measured both ways**: the DDP fp32 step
  less the step without communication is the communication's measured cost; what of it the model
  does not explain (above all the host CPU a collective uses on a small or busy host, which the model
  does not price: gloo's copies and reductions on half a core cost more than the wire at 1 Gbit/s) is
  charged per byte sent, to every codec by its own bytes. Its speed-up is the calibrated DDP fp32
  step over its calibrated step; its step, the measured DDP fp32 step divided by that speed-up.
* **Through the switch** (a cluster spec with ``switch:``, ``thinwire doctor --cluster SPEC``): int8 is
  tried a second time, summed by the aggregator on the switch (``int8@switch``, as ``auto`` names it), and
  judged by its trial like the codecs; the command it recommends trains with ``--aggregation switch``.
* **Sync modes**, each priced by the class that runs it (:meth:`SyncMode.step_s`) with the best codec
  (gossip, which sends fp32 parameters, with fp32's).
  Their loss at equal samples is not predicted, so they are shown, never recommended; where no codec is
  worth a change but a sync mode is priced faster, the advice says so and how to measure it.
* **The recommendation**: the codec with the largest speed-up, when it is at least
  :data:`WORTH` (5%); otherwise "keep DDP fp32", said plainly. Lossy codecs change the loss at equal
  samples: the recommendation says how to check that (``thinwire profile`` runs the convergence guard
  and ``thinwire plan`` ranks by time to fp32's loss).
* **With the convergence guard** (``thinwire doctor --guard PROFILE``, a ``thinwire profile`` of the same
  workload; :func:`apply_guard`): the same guard as ``plan`` and ``auto``. A codec it says does not reach
  fp32's loss, or has no record of, is shown but never recommended; the others are ranked by time to
  fp32's loss: speed-up per step over the samples the guard says they need (its sample factor).
"""

from __future__ import annotations

import dataclasses
import statistics

from thinwire.compress.schemes.switched import VIA, base_spec
from thinwire.compress.spec import default_candidates
from thinwire.compress.sync import StepParts, kind
from thinwire.perf.model import Network, predict_step
from thinwire.sim.inputs import buckets_of, codec_model, compute_at
from thinwire.syncspec import SHOWN, parse_sync_spec

WORTH = 1.05          # a predicted speed-up below this is not worth a change
SLOW_HOST = 1.3       # a rank this much slower than the median rank is named
SLOW_LINK = 0.5       # a pair this much below the median pair's rate is named
GOSSIP = ("gossip:topology=exp2", "gossip:topology=ring")


def advise(*, ranks: list[dict], network: dict, pairs: list[dict], profile, per_rank_batch: int,
           steals: bool, workload: str, codecs: tuple[str, ...] | None = None, cluster: str | None = None,
           job: str | None = None) -> dict:
    """The report (module docstring); ``codecs`` may name ``CODEC@switch`` (tried through the aggregator on
    ``cluster``'s switch); ``job``: ``thinwire train``'s options for the job measured (workload, model, data,
    batch, workers), which the recommended command keeps."""
    job = job or _job({"workload": workload, "cluster": cluster})
    codecs = codecs or default_candidates()
    p = len(ranks)
    floors = [r["floor_s"] for r in ranks]
    ddp = statistics.median(r["ddp_s"] for r in ranks)
    comm_share = max(0.0, 1 - max(floors) / ddp) if p > 1 else 0.0  # one rank sends nothing: the rest is noise
    comp = compute_at(profile, per_rank_batch)
    speeds = [comp.total_s / f for f in floors]
    net = Network(alpha_s=network["alpha_s"], beta_s_per_byte=network["beta_s_per_byte"])
    buckets = buckets_of(profile)
    preds = {c: predict_step(buckets=buckets, compute=comp, speeds=speeds, network=net,
                             codec=codec_model(base_spec(c), profile, switch=c != base_spec(c)),
                             codec_steals_compute=steals) for c in codecs}
    pn = preds["none"]
    # the measured communication cost the model does not explain, charged per byte (module docstring)
    # never negative: where the model says more than was measured (a noisy profile's straggler allowance), a
    # negative charge per byte would make every codec that sends less look slower
    unexplained = max(0.0, (ddp - max(floors)) - (pn.step_s - pn.compute_s)) if p > 1 else 0.0
    per_byte = unexplained / pn.bytes_per_rank if pn.bytes_per_rank else 0.0

    def calibrated(pr) -> float:
        return max(pr.compute_s, pr.step_s + per_byte * pr.bytes_per_rank)

    base = calibrated(pn)
    tried = {c: statistics.median(r["trials"][c] for r in ranks) for c in codecs
             if all(c in r.get("trials", {}) for r in ranks)}
    rows = []
    for c, pr in preds.items():
        model_speedup = base / calibrated(pr)
        measured = tried.get(c) if "none" in tried else None
        speedup = tried["none"] / measured if measured else model_speedup
        # the sync modes price their steps from these (with this codec): kept, so the guard can price them again
        parts = StepParts(allreduce_step_s=calibrated(pr), compute_s=pr.compute_s + pr.noise_s,
                          comm_s=max(0.0, pr.comm_s + per_byte * pr.bytes_per_rank), codec_s=pr.codec_s,
                          codec_steals_compute=steals, hosts=p)
        rows.append({"codec": c, "predicted_step_s": measured or ddp / speedup, "speedup": speedup,
                     "source": "trial" if measured else "model", "model_speedup": model_speedup,
                     "model_step_s": pr.step_s, "uncalibrated_speedup": pn.step_s / pr.step_s,
                     "bytes_per_rank": pr.bytes_per_rank, "exposed_comm_s": pr.exposed_comm_s,
                     "step_parts": dataclasses.asdict(parts)})
    rows.sort(key=lambda r: -r["speedup"])
    best = rows[0]
    # gossip sends fp32 parameters: priced from fp32's all-reduce
    fp32_parts = StepParts(allreduce_step_s=base, compute_s=pn.compute_s + pn.noise_s,
                           comm_s=max(0.0, pn.comm_s + unexplained), codec_s=0.0, codec_steals_compute=steals, hosts=p)
    median_floor = statistics.median(floors)
    slow_hosts = [{"rank": i, "floor_s": f, "x_median": f / median_floor} for i, f in enumerate(floors)
                  if f > SLOW_HOST * median_floor]
    rates = [q["bps"] for q in pairs]
    slow_links = [] if not rates else [q for q in pairs if q["bps"] < SLOW_LINK * statistics.median(rates)]
    worth = best["codec"] != "none" and best["speedup"] >= WORTH
    report = {
        "workload": workload, "job": job, "world_size": p, "per_rank_batch": per_rank_batch, "cluster": cluster,
        "measured": {"ddp_fp32_step_s": ddp, "no_comm_step_s": max(floors), "comm_share": comm_share,
                     "per_rank": ranks, "allreduce": network, "pairs": pairs},
        "model": {"ddp_fp32_step_s": pn.step_s, "error_vs_measured": pn.step_s / ddp - 1, "speeds": speeds,
                  "unexplained_comm_s": unexplained, "charged_per_byte_s": per_byte, "calibrated_fp32_step_s": base,
                  "fp32_step_parts": dataclasses.asdict(fp32_parts)},
        "codecs": rows, "sync_modes": [], "slow_hosts": slow_hosts, "slow_links": slow_links,
    }
    report["sync_modes"] = sync_rows = _sync_rows(report, best)
    report["recommendation"] = _recommend(worth, best, comm_share, job, cluster, sync_rows)
    return report


def _sync_rows(report: dict, best: dict) -> list[dict]:
    """Every shown sync mode priced with ``best``'s codec (the modes that average parameters through a codec),
    gossip with fp32's parameters, from the parts the codec rows keep; speed-ups against calibrated DDP fp32."""
    base, ddp = report["model"]["calibrated_fp32_step_s"], report["measured"]["ddp_fp32_step_s"]
    parts, fp32_parts = StepParts(**best["step_parts"]), StepParts(**report["model"]["fp32_step_parts"])
    rows = []
    for text, codec, at in [*((t, best["codec"], parts) for t in SHOWN), *((t, "none", fp32_parts) for t in GOSSIP)]:
        spec = parse_sync_spec(text)
        step = kind(spec).step_s(spec, at)
        rows.append({"sync": text, "codec": codec, "speedup": base / step, "predicted_step_s": ddp * step / base})
    return rows


def _commands(c: str, job: str, cluster: str | None) -> dict:
    """How to train with candidate ``c``: ``thinwire train``'s command and, but through the switch, the line in
    the user's own DDP script."""
    if c.endswith(VIA):
        return {"command": f"thinwire train {job} --compression {base_spec(c)} "
                           "--aggregation switch", "in_your_script": None}
    return {"command": f"thinwire train {job} --compression {c}",
            "in_your_script": f'thinwire.attach(ddp_model, "{c}")'}


def _sync_instead(sync_rows: list[dict], job: str) -> str:
    """Where no codec is worth it, the fastest sync mode that would be (fewer collectives help where a
    collective's latency, not its bytes, is the cost): shown with its price, not recommended."""
    best = max(sync_rows, key=lambda r: r["speedup"], default=None)
    if best is None or best["speedup"] < WORTH:
        return "nothing thinwire offers will help this job here; keep DDP fp32"
    return (f"keep DDP fp32's averaging, or measure a sync mode that communicates less often: {best['sync']} is priced "
            f"{best['speedup']:.2f}x faster per step, but its loss at equal samples is not predicted (compare "
            f"`thinwire train {job} --sync {best['sync']} --compression {best['codec']}` with "
            "`--sync allreduce --compression none` at equal steps)")


def _recommend(worth: bool, best: dict, comm_share: float, job: str, cluster: str | None = None,
               sync_rows: list[dict] = ()) -> dict:
    if not worth:
        return {"action": "keep", "codec": "none",
                "why": f"communication is {comm_share:.0%} of the step and no codec makes it more than "
                       f"{WORTH - 1:.0%} faster: {_sync_instead(list(sync_rows), job)}",
                "command": None}
    c = best["codec"]
    than = ("fp32 through the same hook in the same trials" if best["source"] == "trial" else
            "DDP fp32 (by the model)")
    return {"action": "compress", "codec": c, "speedup": best["speedup"],
            "why": f"communication is {comm_share:.0%} of the step; {c} is {best['speedup']:.2f}x faster per step than "
                   f"{than}. Its loss at equal samples is not measured here: `thinwire profile` runs the "
                   "convergence guard and `thinwire plan` ranks codecs by time to fp32's loss",
            **_commands(c, job, cluster)}


def _job(report: dict) -> str:
    """The report's job options; for a report from before it kept them, its workload and cluster."""
    return report.get("job") or f"--workload {report['workload']}" + (f" --cluster {report['cluster']}" if report.get("cluster") else "")


def job_args(cfg, world: int) -> str:
    """``thinwire train``'s options for the job doctor measured: its workload, model options, data, global batch
    and where it ran (the cluster spec, or as many local workers)."""
    import shlex

    parts = ["--workload", cfg.workload]
    import yaml

    for key, value in (cfg.model or {}).items():  # as YAML, which --set reads back (None: null, not 'None')
        text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
        parts += ["--set", f"model.{key}={text.removesuffix(chr(10) + '...').strip()}"]
    if cfg.data:
        parts += ["--data", cfg.data]
    if cfg.batch_size:
        parts += ["--batch-size", str(cfg.batch_size)]
    parts += ["--cluster", cfg.cluster] if cfg.cluster else ["--nproc", str(world)]
    return " ".join(shlex.quote(str(p)) for p in parts)


def apply_guard(report: dict, records: dict, source: str) -> dict:
    """``report`` with each codec's guard verdict (``records``: codec -> the profile's
    :class:`~thinwire.measure.file.ConvergenceRecord`, from ``source``) and the recommendation made again by
    time to fp32's loss among the codecs the guard lets through (module docstring)."""
    from thinwire.compress.spec import parse_codec_spec, spec_string

    def canonical(spec: str) -> str:  # the profile keys its records so: topk:ratio=0.01 (the default) is topk
        try:
            return spec_string(parse_codec_spec(spec))
        except Exception:  # noqa: BLE001 - a form the parser does not take is looked up as written
            return spec

    records = {canonical(k): v for k, v in records.items()}
    for row in report["codecs"]:
        c = row["codec"]
        r = None if c == "none" else records.get(canonical(base_spec(c)))  # int8@switch: int8's rounding
        row["guard"] = ({"reaches": True, "gap": 0.0, "factor": 1.0} if c == "none" else None if r is None else
                        {"reaches": r.reaches and r.factor is not None, "gap": r.relative_gap, "factor": r.factor})
        g = row["guard"]
        row["time_speedup"] = row["speedup"] / g["factor"] if g and g["reaches"] else None
    kept = sorted((row for row in report["codecs"] if row["time_speedup"] is not None), key=lambda r: -r["time_speedup"])
    out = [row["codec"] for row in report["codecs"] if row["time_speedup"] is None]
    best = kept[0]
    # the sync modes priced again with the codec the guard puts first (a report written before the rows kept
    # their parts keeps its sync rows as they were)
    if "step_parts" in best:
        report["sync_modes"] = _sync_rows(report, best)
    worth = best["codec"] != "none" and best["time_speedup"] >= WORTH
    comm_share = report["measured"]["comm_share"]
    left = (f" Left out by the guard: {', '.join(out)} (it says they do not reach fp32's loss within 1% at equal "
            "samples, or it has no record of them)." if out else "")
    if not worth:
        rec = {"action": "keep", "codec": "none",
               "why": f"communication is {comm_share:.0%} of the step and no codec the convergence guard ({source}) "
                      f"lets through reaches DDP fp32's loss more than {WORTH - 1:.0%} sooner: "
                      f"{_sync_instead(report['sync_modes'], _job(report))}.{left}",
               "command": None}
    else:
        c = best["codec"]
        rec = {"action": "compress", "codec": c, "speedup": best["speedup"], "time_speedup": best["time_speedup"],
               "why": f"communication is {comm_share:.0%} of the step; {c} is {best['speedup']:.2f}x faster per step "
                      f"than DDP fp32 and needs {best['guard']['factor']:.2f}x its samples by the convergence guard "
                      f"({source}): {best['time_speedup']:.2f}x sooner to fp32's loss.{left}",
               **_commands(c, _job(report), report.get("cluster"))}
    report["recommendation"] = rec
    report["guard"] = source
    return report
