"""benchmarks/link_burst.py's table: times less a 1 KiB message's, against the link's rate."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import link_burst  # noqa: E402


def test_table_subtracts_the_small_message_and_gives_the_rate():
    times = {f"{w}/{k}": (0.001 if w == "0.02" else 0.002) + k * 1e-5 for w in ("0.02", "0") for k in link_burst.SIZES_KIB}
    result = {"command": "c", "started": "s", "commit": "x", "rate_bps": 100e6, "bucket_bytes": 32768, "gap_s": 0.02,
              "reps": 5, "times_s": times}
    md = link_burst.markdown(result)
    assert "| 1 KiB | 0.00 | 0.00 | 0.08 |" in md
    assert "| 64 KiB | 0.63 | 0.63 | 5.24 |" in md  # (64 - 1) * 10 us after both gaps; 64 KiB at 100 Mbit/s
    assert "bucket 32 KiB" in md and "after 20 ms idle" in md
