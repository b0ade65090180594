"""How long one message takes on an emulated link, by size, after an idle gap and back to back.

The emulator shapes each host's link with tbf (:func:`thinwire.cluster.netns.tbf_args`), whose bucket
holds at least 32 KiB so that the kernel's GSO packets pass whole. After the link idles long enough to
refill it, that much passes at once, at the speed of the veth, not at the link's rate. A real link of
that rate has no such credit. This script measures it: two hosts at ``--rate``, host 0 sends a message
of each size to host 1 (gloo ``send``/``recv``) and waits for a 1-byte reply; each size ``--reps``
times, after ``--gap`` seconds of idle (the bucket refilled) and with no gap (the bucket as the last
message left it). The table gives the median round trip less a 1 KiB message's, against the size's time
at the link's rate. ``thinwire.sim.pipeline`` charges every message the link's rate, which is what a
real link costs; issue 23's bf16 activations (32 KiB messages between idle gaps) are where the two part.

    sudo .venv/bin/python benchmarks/link_burst.py                  # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES_KIB = (1, 8, 16, 24, 32, 40, 48, 64, 96, 128, 256)
PORT = 29671


def _rank(rank: int, master: str, gap: float, reps: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(PORT))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ack = torch.zeros(1, dtype=torch.uint8)
    out = {}
    for wait in (gap, 0.0):
        for kib in SIZES_KIB:
            buf = torch.zeros(kib * 1024, dtype=torch.uint8)
            times = []
            for _ in range(reps + 2):  # the first two warm the connection up
                if rank == 0:
                    time.sleep(wait)
                    t0 = time.perf_counter()
                    dist.send(buf, 1)
                    dist.recv(ack, 1)
                    times.append(time.perf_counter() - t0)
                else:
                    dist.recv(buf, 0)
                    dist.send(ack, 0)
            out[f"{wait:g}/{kib}"] = statistics.median(times[2:]) if rank == 0 else None
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)


def markdown(result: dict) -> str:
    rate = result["rate_bps"]
    L = ["# One message on an emulated link: the token bucket's credit after an idle gap\n",
         f"Command: `{result['command']}`  ",
         f"Run {result['started']} UTC at commit {result['commit']}. Two hosts at {rate / 1e6:g} Mbit/s (tbf, "
         f"bucket {result['bucket_bytes'] // 1024} KiB), gloo send then a 1-byte reply, {result['reps']} reps per "
         "size, medians; the time is the round trip less a 1 KiB message's.\n",
         f"| message | after {result['gap_s'] * 1e3:g} ms idle (ms) | back to back (ms) | at the link's rate (ms) |",
         "|---:|---:|---:|---:|"]
    t = result["times_s"]
    for kib in SIZES_KIB:
        idle = t[f"{result['gap_s']:g}/{kib}"] - t[f"{result['gap_s']:g}/1"]
        busy = t[f"0/{kib}"] - t["0/1"]
        L.append(f"| {kib} KiB | {idle * 1e3:.2f} | {busy * 1e3:.2f} | {kib * 1024 * 8 / rate * 1e3:.2f} |")
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--gap", type=float, default=0.02, help="idle seconds before each message (default 0.02)")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        _rank(a.rank, a.master, a.gap, a.reps)
        return 0
    if os.geteuid() != 0:
        print("link_burst.py needs root for the emulated cluster (network namespaces, tc, cgroups).")
        return 2
    import subprocess

    from thinwire.cluster.emulator import EmulatedCluster
    from thinwire.cluster.netns import tbf_args
    from thinwire.cluster.spec import load_cluster_spec

    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="thinwire-burst-") as tmp:
        spec_path = Path(tmp) / "burst.yaml"
        spec_path.write_text(f"name: burst\nsubnet: 10.243.0.0/24\ndefaults: {{bandwidth: {a.rate}}}\n"
                             "hosts: [{name: h0}, {name: h1}]\n")
        spec = load_cluster_spec(spec_path)
        cluster = EmulatedCluster(spec)
        cluster.up()
        try:
            master = spec.address("h0")
            argv = lambda r: [sys.executable, __file__, "--rank", str(r), "--master", master, "--gap", str(a.gap),
                              "--reps", str(a.reps)]
            peer = cluster.host("h1").spawn(argv(1), stdout=subprocess.DEVNULL)
            lead = cluster.host("h0").spawn(argv(0), stdout=subprocess.PIPE, text=True)
            out, _ = lead.communicate(timeout=600)
            peer.wait(timeout=60)
        finally:
            cluster.down()
    rate = spec.hosts[0].bandwidth
    args = tbf_args(rate)
    result = {"command": "sudo .venv/bin/python benchmarks/link_burst.py " + " ".join(sys.argv[1:]),
              "started": started, "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                          capture_output=True, text=True).stdout.strip(),
              "rate_bps": rate, "bucket_bytes": int(args[args.index("burst") + 1]), "gap_s": a.gap, "reps": a.reps,
              "times_s": json.loads(out.strip().splitlines()[-1])}
    folder = Path(a.out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "link_burst.json").write_text(json.dumps(result, indent=1))
    (folder / "link_burst.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
