"""Dynamic averaging's rules at equal samples (issue 22): ``rule=drift`` (each rank's distance from the
last average, a one-byte vote) against ``rule=spread`` (the ranks' spread around their mean, from a
256-value sketch per rank) and the drift rule with ``by_lr=1`` (its threshold scaled by the learning rate
over its peak), each at several thresholds, against periodic averaging, on local workers:

* ``charlm``: 4 workers with a file each (``--partition by_file``), 200 steps, seed 0 (the workload the
  drift rule's default threshold was chosen on, ``dynamic_threshold.md``);
* ``digits``: 8 workers with label-skewed shards (Dirichlet alpha 0.5), 300 steps, seeds 0, 1, 2: the
  data of ``decentral.md``'s skew scenario (its losses and bytes on the emulated cluster are those of
  local workers: they do not depend on the links);
* ``digits-iid``: the same with i.i.d. shards, seed 0: where the ranks agree, what each rule sends.

Loss and bytes at equal samples do not depend on the machine's speed, so the runs are local and not
interleaved. Every run is saved to ``dynamic_rules.json`` as it ends; a second call skips what is there.

    .venv/bin/python benchmarks/dynamic_rules.py
    .venv/bin/python benchmarks/dynamic_rules.py --rerender
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from decentral import slug  # noqa: E402
from guard_eval import write_json  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
CONTROL = "local:period=4,warmup=0"
WORKLOADS = {
    "charlm": dict(args=["--workload", "charlm", "--partition", "by_file", "--steps", "200", "--eval-every", "25",
                         "--checkpoint-every", "200", "--nproc", "4"], seeds=[0],
                   syncs=[CONTROL, "local:period=20,warmup=0", "local:period=40,warmup=0",
                          *(f"dynamic:threshold={d}" for d in (0.05, 0.1, 0.3)),
                          *(f"dynamic:threshold={d},rule=spread" for d in (0.02, 0.05, 0.1)),
                          *(f"dynamic:threshold={d},by_lr=1" for d in (0.1, 0.3, 0.6))]),
    "digits": dict(args=["--workload", "digits", "--partition", "label_skew:alpha=0.5", "--steps", "300",
                         "--batch-size", "64", "--eval-every", "15", "--checkpoint-every", "300", "--nproc", "8"],
                   seeds=[0, 1, 2],
                   syncs=[CONTROL, "local:period=40,warmup=0", "dynamic:threshold=0.1",
                          *(f"dynamic:threshold={d},rule=spread" for d in (0.05, 0.1, 0.2, 0.3)),
                          *(f"dynamic:threshold={d},by_lr=1" for d in (0.3, 0.6))]),
    "digits-iid": dict(args=["--workload", "digits", "--partition", "iid", "--steps", "300", "--batch-size", "64",
                             "--eval-every", "15", "--checkpoint-every", "300", "--nproc", "8"], seeds=[0],
                       syncs=[CONTROL, "dynamic:threshold=0.05", "dynamic:threshold=0.1",
                              *(f"dynamic:threshold={d},rule=spread" for d in (0.05, 0.1))]),
}


def command(workload: str, sync: str, seed: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "thinwire", "train", *WORKLOADS[workload]["args"], "--threads", "1", "--seed",
            str(seed), "--compression", "none", "--sync", sync, "--out", str(out)]


def run(workload: str, sync: str, seed: int, work: Path) -> dict:
    out = work / f"{workload}-{slug(sync)}-s{seed}"
    proc = subprocess.run(command(workload, sync, seed, out), env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    s = json.loads((out / "summary.json").read_text())
    return {"val_loss": s["val_loss"], "bytes_all_ranks": s["bytes_sent_total_all_ranks"], "sync_stats": s.get("sync", {})}


def render(data: dict, out: Path) -> None:
    lines = ["# Dynamic averaging: the drift rule, the spread rule and a threshold that follows the learning rate (issue 22)", "",
             "Command: `" + data["command"] + "`  ",
             f"Runs {data['started']} to {data['ended']} UTC (commits {', '.join(data['commits'])}), local workers; "
             "one run per (workload, `--sync`, seed), its command `thinwire train "
             + " ".join(WORKLOADS["charlm"]["args"]) + " --threads 1 --seed S --compression none --sync SYNC` for "
             "charlm and `" + " ".join(WORKLOADS["digits"]["args"]) + "` in its place for digits (`--partition iid` for "
             "digits-iid). Bytes: all ranks, "
             "the whole run's training payload (validation's averages apart). Gap and fewer bytes: against "
             f"`{CONTROL}` (the rule both reduce to at threshold 0), medians over seeds.", ""]
    for w, spec in WORKLOADS.items():
        runs = data["runs"].get(w, {})
        lines += [f"## {w} (seeds {', '.join(map(str, spec['seeds']))})", "",
                  "| --sync | final val loss (per seed) | median | vs every 4 steps | MB, all ranks (median) | fewer bytes "
                  "| averages / checks |", "|---|---|---:|---:|---:|---:|---|"]
        rows = {}
        for sync in spec["syncs"]:
            rs = [runs.get(f"{sync}@{k}") for k in spec["seeds"]]
            ok = [r for r in rs if r and "error" not in r]
            if ok:
                rows[sync] = (statistics.median(r["val_loss"] for r in ok),
                              statistics.median(r["bytes_all_ranks"] for r in ok) / 1e6, rs)
        base = rows.get(CONTROL)
        for sync, (loss, mb, rs) in rows.items():
            per = ", ".join("-" if not r or "error" in r else f"{r['val_loss']:.4f}" for r in rs)
            avg = ", ".join(f"{r['sync_stats']['syncs']}/{r['sync_stats']['checks']}" if r and "syncs" in
                            r.get("sync_stats", {}) else "-" for r in rs)
            gap = f"{loss / base[0] - 1:+.1%}" if base else "-"
            fewer = f"{base[1] / mb:.1f}x" if base and mb else "-"
            lines.append(f"| `{sync}` | {per} | {loss:.4f} | {gap} | {mb:.1f} | {fewer} | {avg} |")
        lines.append("")
    (out / "dynamic_rules.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rerender", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    path = out / "dynamic_rules.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}, "commits": []}
    if not args.rerender:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        data["command"] = ".venv/bin/python benchmarks/dynamic_rules.py"
        data["commits"] = sorted(set(data["commits"]) | {commit})
        data.setdefault("started", time.strftime("%Y-%m-%d %H:%M", time.gmtime()))
        with tempfile.TemporaryDirectory(prefix="dynamic-rules-") as tmp:
            for w, spec in WORKLOADS.items():
                runs = data["runs"].setdefault(w, {})
                for k in spec["seeds"]:
                    for sync in spec["syncs"]:
                        if f"{sync}@{k}" in runs:
                            continue
                        r = runs[f"{sync}@{k}"] = run(w, sync, k, Path(tmp))
                        print(f"{w} seed {k} {sync}: " + (f"FAILED {r['error'][-300:]}" if "error" in r else
                              f"loss {r['val_loss']:.4f}, {r['bytes_all_ranks'] / 1e6:.1f} MB, {r['sync_stats']}"),
                              flush=True)
                        write_json(path, data)
                        render(data, out)
    render(data, out)
    print((out / "dynamic_rules.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
