"""The performance model's switch and offload prices against measured step times (issue 24's model item).

The cases are the settings issue 24's other results run at, with the workload of ``sync_model.py``
(charlm 2 layers x 128, context 64, global batch 32, one thread per worker):

* **switch**, 4 hosts x 100 Mbit/s, the 2 cores split evenly, an aggregator of 0.25 core on the switch
  (as ``compare.py``'s ``int8+switch`` contender): int8 around the ring and int8 through the switch.
* **offload**, 4 hosts x 1 Gbit/s (as ``offload.py``): hosts of 0.3 core with an engine of 0.15 core
  (spec ``nic:``), the codec offloaded (thinwire's default) and inline (``--set offload=off``, priced as
  the same hosts without an engine, which is what inline leaves them); and hosts of 0.45 core without
  an engine. int8 and bfp.

For each case: ``thinwire profile`` on this machine (once per link rate, with the cluster's links
probed), ``thinwire simulate`` prices the case, and ``thinwire train --cluster`` runs it ``--reps``
times, the cases interleaved (every case once, then again). The measured value is the mean step after
the first 20 steps (what the model prices), median over runs; the median step is shown too. The ratio
is predicted / measured; issue 24 asks the switch and offload predictions within 15% of measured.

    sudo .venv/bin/python benchmarks/nic_model.py                 # ~15 min on 2 cores
    sudo .venv/bin/python benchmarks/nic_model.py --cases switch --reps 1

The profiles a run prices from are kept next to its result (``NAME_profiles/``). After a change to the
model, ``--reprice`` prices the stored runs again from them (no root, nothing measured); each row keeps
its earlier price as ``predicted_s_before``; a hand-written ``provenance`` (and ``title``) in the JSON stays in the report:

    .venv/bin/python benchmarks/nic_model.py --reprice
"""

from __future__ import annotations

import argparse
import json
import shutil
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from sync_model import BATCH, MODEL, SKIP, measure, model_args, predict, run_thinwire  # noqa: E402
from thinwire.cluster.emulator import EmulatedCluster  # noqa: E402
from thinwire.cluster.spec import load_cluster_spec  # noqa: E402

HOSTS = 4
SWITCH_CPU = 0.25
TITLE = "The switch and the offload engine: predicted against measured step (issue 24's model item)"


def switch_spec(cpu: float | None) -> str:
    """4 hosts x 100 Mbit/s, the cores split evenly, an aggregator of ``cpu`` cores (None: no cap) on the switch."""
    return f"""name: nicm-switch
subnet: 10.239.0.0/24
defaults: {{bandwidth: 100mbit, cpu: {round((os.cpu_count() or 2) / HOSTS, 3)}}}
switch: {{cpu: {'null' if cpu is None else cpu}}}
hosts: [{{name: h0}}, {{name: h1}}, {{name: h2}}, {{name: h3}}]
"""


#: spec name -> (YAML, the spec whose links its profile probes); every spec has its own subnet
SPECS = {
    "switch": (switch_spec(SWITCH_CPU), "switch"),
    "engine": ("""name: nicm-engine
subnet: 10.240.0.0/24
defaults: {bandwidth: 1gbit, cpu: 0.3, nic: {cpu: 0.15}}
hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]
""", "engine"),
    "engine-off": ("""name: nicm-engine-off
subnet: 10.241.0.0/24
defaults: {bandwidth: 1gbit, cpu: 0.3}
hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]
""", "engine"),
    "no-engine": ("""name: nicm-no-engine
subnet: 10.242.0.0/24
defaults: {bandwidth: 1gbit, cpu: 0.45}
hosts: [{name: h0}, {name: h1}, {name: h2}, {name: h3}]
""", "engine"),
}


def cases(codecs: list[str]) -> list[dict]:
    """(group, label, the spec it runs on, the spec it is priced on, train's args, simulate's args)."""
    out = [{"group": "switch", "label": "int8, ring", "run_on": "switch", "priced_on": "switch",
            "train": ["--compression", "int8"], "simulate": ["--compression", "int8"]},
           {"group": "switch", "label": "int8, switch", "run_on": "switch", "priced_on": "switch",
            "train": ["--compression", "int8", "--aggregation", "switch"],
            "simulate": ["--compression", "int8", "--aggregation", "switch"]}]
    for c in codecs:
        out += [{"group": "offload", "label": f"{c}, 0.3 core + engine 0.15, offloaded", "run_on": "engine",
                 "priced_on": "engine", "train": ["--compression", c], "simulate": ["--compression", c]},
                {"group": "offload", "label": f"{c}, 0.3 core + engine 0.15, inline", "run_on": "engine",
                 "priced_on": "engine-off", "train": ["--compression", c, "--set", "offload=off"],
                 "simulate": ["--compression", c]},
                {"group": "offload", "label": f"{c}, 0.45 core, no engine", "run_on": "no-engine",
                 "priced_on": "no-engine", "train": ["--compression", c], "simulate": ["--compression", c]}]
    return out


def summarize(rows: list[dict], codecs: list[str]) -> dict:
    """Each row's measured medians and ratio (in place); per group the median |error| and the cases within
    15%; the predicted and measured speed-ups the issue's other items name (switch over ring, offloaded
    over inline)."""
    for r in rows:
        r["measured_mean_s"] = statistics.median(x["mean_s"] for x in r["runs"])
        r["measured_median_s"] = statistics.median(x["median_s"] for x in r["runs"])
        r["ratio"] = r["predicted_s"] / r["measured_mean_s"]
    by = {g: [r for r in rows if r["group"] == g] for g in ("switch", "offload") if any(r["group"] == g for r in rows)}
    speedups = {}
    if "switch" in by:  # how much sooner a step ends through the switch than around the ring
        ring, sw = by["switch"]
        speedups["switch over ring"] = (ring["predicted_s"], sw["predicted_s"], ring["measured_mean_s"],
                                        sw["measured_mean_s"])
    for codec in (codecs if "offload" in by else []):
        off, inline = (next(r for r in by["offload"] if r["label"].startswith(f"{codec},") and r["label"].endswith(k))
                       for k in ("offloaded", "inline"))
        speedups[f"{codec} offloaded over inline"] = (inline["predicted_s"], off["predicted_s"],
                                                      inline["measured_mean_s"], off["measured_mean_s"])
    return {"median_abs_error": {g: statistics.median(abs(r["ratio"] - 1) for r in rs) for g, rs in by.items()},
            "within_15": {g: (sum(abs(r["ratio"] - 1) <= 0.15 for r in rs), len(rs)) for g, rs in by.items()},
            "speedups": speedups}


def markdown(result: dict) -> str:
    L = [f"# {result.get('title', TITLE)}\n",
         *([result["provenance"] + "\n"] if result.get("provenance") else []),
         f"Command: `{result['command']}`  ",
         f"Run {result['started']} to {result['ended']}. Workload: charlm {MODEL}, global batch {BATCH}, one thread "
         f"per worker, {result['steps']} steps per run, {result['reps']} runs per case interleaved, the mean step "
         f"after step {SKIP} measured. Prediction: `thinwire simulate` from a `thinwire profile` taken in the same "
         "run (one per link rate, the cluster's links probed), priced as an emulated cluster (hosts share this "
         "machine's cores). Switch cases: 4 hosts x 100 Mbit/s, the cores split evenly, an aggregator of "
         f"{result.get('switch_cpu', SWITCH_CPU)} core. Offload cases: 4 hosts x 1 Gbit/s; inline is priced as the same hosts without an "
         "engine (what `--set offload=off` leaves them).\n",
         "| case | predicted (ms) | measured mean (ms) | measured median (ms) | each run's mean (ms) | "
         "predicted / measured |", "|---|---:|---:|---:|---|---:|"]
    for group in ("switch", "offload"):
        rows = [r for r in result["rows"] if r["group"] == group]
        for r in rows:
            each = ", ".join(f"{x['mean_s'] * 1e3:.0f}" for x in r["runs"])
            L.append(f"| {group}: {r['label']} | {r['predicted_s'] * 1e3:.1f} | {r['measured_mean_s'] * 1e3:.1f} | "
                     f"{r['measured_median_s'] * 1e3:.1f} | {each} | {r['ratio']:.2f} |")
    L.append("")
    before = [r for r in result["rows"] if "predicted_s_before" in r]
    if before:
        L.append("Repriced from the kept profiles after a model change (`--reprice`; nothing measured again); the "
                 "earlier prediction: " + "; ".join(f"{r['group']}: {r['label']} {r['predicted_s_before'] * 1e3:.1f} ms"
                                                     for r in before) + ".\n")
    for group, err in result["median_abs_error"].items():
        within = result["within_15"][group]
        L.append(f"- {group}: median |predicted / measured - 1| {err:.1%}; within 15%: {within[0]} of {within[1]} cases.")
    for group, (pa, pb, ma, mb) in result["speedups"].items():
        L.append(f"- {group}: predicted speed-up {pa / pb:.2f}x, measured {ma / mb:.2f}x.")
    L.append(f"\nTotal {result['elapsed_s'] / 60:.1f} min; load average at the end {tuple(result['load_average_at_end'])}.")
    return "\n".join(L) + "\n"


def write_specs(work: Path) -> dict[str, Path]:
    """Every spec of :data:`SPECS` as a file in ``work``."""
    specs = {}
    for name, (text, _) in SPECS.items():
        specs[name] = work / f"{name}.yaml"
        specs[name].write_text(text)
    return specs


def reprice(result: dict, profiles: Path) -> None:
    """Price the stored rows again from the profiles kept with them (the model changed; nothing measured),
    the earlier price kept as ``predicted_s_before``; the summary follows."""
    SPECS["switch"] = (switch_spec(result.get("switch_cpu")), "switch")
    with tempfile.TemporaryDirectory(prefix="thinwire-nicmodel-") as tmp:
        specs = write_specs(Path(tmp))
        for r in result["rows"]:
            profile = profiles / f"profile-{SPECS[r['priced_on']][1]}.yaml"
            if not profile.is_file():
                raise SystemExit(f"--reprice: no stored profile {profile}; this result was measured before profiles "
                                 "were kept. Run the benchmark again.")
            r["predicted_s_before"] = r["predicted_s"]
            r["predicted_s"] = predict(specs[r["priced_on"]], profile, r["simulate"])["predicted_s"]
    result.update(summarize(result["rows"], sorted({r["label"].split(",")[0] for r in result["rows"]
                                                     if r["group"] == "offload"})))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--codecs", default="int8,bfp", help="codecs of the offload cases")
    ap.add_argument("--cases", default="switch,offload", help="groups to run: switch, offload or both")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default="nic_model")
    ap.add_argument("--switch-cpu", type=float, default=SWITCH_CPU, help="the aggregator's cores (0: no cap)")
    ap.add_argument("--reprice", action="store_true", help="price the stored runs of --name again from their kept "
                                                          "profiles (after a model change; no root, nothing measured)")
    args = ap.parse_args()
    folder = Path(args.out)
    if args.reprice:
        path = folder / f"{args.name}.json"
        if not path.is_file():
            raise SystemExit(f"--reprice: no stored runs at {path}; run the benchmark first, or give --name NAME of "
                             "a stored result")
        result = json.loads(path.read_text())
        reprice(result, folder / f"{args.name}_profiles")
        path.write_text(json.dumps(result, indent=1))
        (folder / f"{args.name}.md").write_text(markdown(result))
        print(markdown(result))
        return 0
    if os.geteuid() != 0:
        print("nic_model.py needs root for the emulated cluster (network namespaces, tc, cgroups).")
        return 2
    groups = set(args.cases.split(","))
    if not groups <= {"switch", "offload"}:
        ap.error(f"--cases must name switch and/or offload, got {args.cases!r}")
    SPECS["switch"] = (switch_spec(args.switch_cpu or None), "switch")
    todo = [c for c in cases(args.codecs.split(",")) if c["group"] in groups]
    codecs = sorted({a for c in todo for a in c["train"][1:2]})
    t0, started = time.time(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="thinwire-nicmodel-") as tmp:
        work = Path(tmp)
        specs = write_specs(work)
        needed = {c["run_on"] for c in todo} | {SPECS[c["priced_on"]][1] for c in todo}
        clusters = [EmulatedCluster(load_cluster_spec(specs[n])) for n in sorted(needed)]
        for c in clusters:
            c.up()
        try:
            profiles = {}
            for name in sorted({SPECS[c["priced_on"]][1] for c in todo}):
                print(f"profiling on {name} ...", flush=True)
                profiles[name] = work / f"profile-{name}.yaml"
                run_thinwire(["profile", *model_args(), "--batch-sizes", str(BATCH // HOSTS), "--threads", "1", "--codecs",
                      ",".join(codecs), "--cluster", str(specs[name]), "--out", str(profiles[name])])
                kept = folder / f"{args.name}_profiles"  # for --reprice
                kept.mkdir(parents=True, exist_ok=True)
                shutil.copy(profiles[name], kept / profiles[name].name)
            rows = []
            for c in todo:
                pred = predict(specs[c["priced_on"]], profiles[SPECS[c["priced_on"]][1]], c["simulate"])
                rows.append({**c, "predicted_s": pred["predicted_s"], "runs": []})
            for rep in range(args.reps):
                order = rows[rep % len(rows):] + rows[: rep % len(rows)]
                for i, r in enumerate(order):
                    print(f"[rep {rep}] {r['group']}: {r['label']} ...", flush=True)
                    r["runs"].append(measure(specs[r["run_on"]], r["train"], args.steps, work / f"run-{rep}-{i}"))
                    print(f"    mean {r['runs'][-1]['mean_s'] * 1e3:.0f} ms, predicted {r['predicted_s'] * 1e3:.0f} ms",
                          flush=True)
        finally:
            for c in clusters:
                c.down()
    summary = summarize(rows, args.codecs.split(","))
    result = {"command": "sudo .venv/bin/python benchmarks/nic_model.py " + " ".join(sys.argv[1:]),
              "started": started, "ended": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "switch_cpu": args.switch_cpu or None, "steps": args.steps, "reps": args.reps, "model": MODEL, "batch": BATCH, "skip": SKIP, "rows": rows,
              **summary, "elapsed_s": time.time() - t0, "load_average_at_end": os.getloadavg()}
    (folder / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (folder / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
