"""A/B of charlm's step time between two commits of thinwire, interleaved in one run.

    sudo .venv/bin/python benchmarks/ab_step.py --base 30b681d --rounds 3 --name ab_refactor

For each round it runs, from a checkout of ``--base`` and from this working tree (the order alternating
from round to round, so a slow spell of the machine does not land on one side):

* ``local``: charlm on 2 local workers (``--nproc 2``, loopback, no shaping), fp32 (no codec);
* ``4x100mbit-int8``: charlm with ``--compression int8`` on an emulated cluster of 4 hosts on
  100 Mbit/s links, the 2 cores split evenly (the head-to-head's setting, ``compare.py``).

Each run's median ``step_time_s`` after its first 3 steps is kept; the result is each side's median
over rounds and the ratio this tree / base. Final validation losses are reported too: the two
trees must train identically (same numerics), so they should agree to float tolerance.
Writes ``benchmarks/results/NAME.json`` and ``NAME.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import compare  # noqa: E402
from thinwire.cluster.emulator import EmulatedCluster  # noqa: E402
from thinwire.cluster.spec import load_cluster_spec  # noqa: E402
from thinwire.train.metrics import read_metrics  # noqa: E402

SETTINGS = {"local": ("none", None), "4x100mbit-int8": ("int8", (4, "100mbit"))}


def checkout(rev: str, work: Path) -> Path:
    """A detached worktree of ``rev`` (its thinwire/ is what PYTHONPATH points the base runs at)."""
    tree = work / f"tree-{rev}"
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
    return tree


def run(tree: Path, setting: str, out: Path, steps: int, batch: int, spec: Path | None) -> dict:
    codec, _ = SETTINGS[setting]
    args = compare.train_args(codec, out, steps, batch, seed=0)
    args += ["--cluster", str(spec)] if spec else ["--nproc", "2"]
    t0 = time.time()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tree, timeout=1800,
                          env={**os.environ, "PYTHONPATH": str(tree)})
    if proc.returncode != 0:
        raise RuntimeError(f"{setting} from {tree} failed: {(proc.stderr or proc.stdout)[-2000:]}")
    records = read_metrics(out)
    steps_s = [r["step_time_s"] for r in records if "step_time_s" in r][3:]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    return {"median_step_s": statistics.median(steps_s), "final_val_loss": vals[-1], "elapsed_s": time.time() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against (e.g. main before a refactor)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--name", default="ab_step")
    ap.add_argument("--work", default="runs/ab", help="run folders and the base checkout")
    args = ap.parse_args()
    work = (ROOT / args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], check=True,
                          capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    trees = {"base": checkout(base, work), "head": ROOT}
    results: dict = {s: {"base": [], "head": []} for s in SETTINGS}
    for setting, (_, cluster) in SETTINGS.items():
        spec = compare.cluster_spec(*cluster, work) if cluster else None
        emulated = EmulatedCluster(load_cluster_spec(spec)) if spec else None
        if emulated:
            emulated.up()
        try:
            for k in range(args.rounds):
                for side in (("base", "head") if k % 2 == 0 else ("head", "base")):
                    out = work / f"{setting}-{side}-r{k}-{int(time.time())}"
                    print(f"[{setting}] round {k}, {side} ...", flush=True)
                    r = run(trees[side], setting, out, args.steps, args.batch, spec)
                    print(f"    {r['median_step_s'] * 1e3:.1f} ms/step, val {r['final_val_loss']:.4f}", flush=True)
                    results[setting][side].append(r)
        finally:
            if emulated:
                emulated.down()
    write(results, args, base, head)
    return 0


def write(results: dict, args, base: str, head: str) -> None:
    command = (f"sudo .venv/bin/python benchmarks/ab_step.py --base {args.base} --rounds {args.rounds} "
               f"--steps {args.steps} --batch {args.batch} --name {args.name}")
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "base": base, "head": head, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
         "results": results}, indent=1))
    rows = ["| setting | base median step (ms) | head median step (ms) | head / base | per round, base | "
            "per round, head | final val loss base / head |", "|---|---:|---:|---:|---|---|---|"]
    for setting, sides in results.items():
        med = {s: statistics.median(r["median_step_s"] for r in v) for s, v in sides.items()}
        per = {s: ", ".join(f"{r['median_step_s'] * 1e3:.1f}" for r in v) for s, v in sides.items()}
        loss = f"{sides['base'][0]['final_val_loss']:.4f} / {sides['head'][0]['final_val_loss']:.4f}"
        rows.append(f"| {setting} | {med['base'] * 1e3:.1f} | {med['head'] * 1e3:.1f} | "
                    f"{med['head'] / med['base']:.3f} | {per['base']} | {per['head']} | {loss} |")
    text = (f"# Step time before and after a change: {base} (base) against {head} (head)\n\n"
            f"Command (as root, from the repo root): `{command}`\n\n"
            f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.rounds} rounds, the two sides "
            f"alternating first; charlm ({', '.join(f'{k}={v}' for k, v in compare.MODEL.items())}), "
            f"{args.steps} steps, global batch {args.batch}; median step after the first 3 steps.\n\n"
            + "\n".join(rows) + "\n")
    (out / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
