"""Known devices: peak throughput, memory and power, each with where the number comes from.

Used for what cannot be measured here (a cluster of Jetsons, of Raspberry Pis, of datacenter GPUs):
compute time is scaled from a profile's FLOPs (``flops / (peak * utilization)``, the inverse of
nanoGPT's ``estimate_mfu``) and energy uses the power figures.

Conventions: ``peak_fp32`` / ``peak_16`` in FLOP/s, dense (vendors often print sparse tensor-core
numbers, twice the dense ones: halved here); ``peak_16`` is bf16 or fp16 tensor math, None where
the device has none worth counting. ``memory`` in bytes. ``busy_w``: power under load (the vendor's
TDP or top power mode; for boards, see the note); ``idle_w``: waiting power. A note that says
*derived* computes a peak as ``units x FLOP/cycle x clock`` from the cited specs; *unverified*
means the figure comes from a secondary source or an assumption and should be measured before a
decision rests on it.
"""

from __future__ import annotations

import dataclasses

GB = 10**9


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    kind: str                # "gpu", "edge-gpu", "cpu-core", "sbc"
    peak_fp32: float         # FLOP/s
    peak_16: float | None    # FLOP/s, bf16/fp16 dense tensor math
    memory: int              # bytes
    busy_w: float            # watts
    idle_w: float            # watts
    source: str

    def compute_s(self, flops: float, *, utilization: float, low_precision: bool = False) -> float:
        """Seconds for ``flops`` at ``utilization`` of peak (MFU; 0.3-0.5 is typical for training)."""
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {utilization}")
        peak = self.peak_16 if low_precision and self.peak_16 else self.peak_fp32
        return flops / (peak * utilization)


_NV = "NVIDIA datasheet"
DEVICES: dict[str, Device] = {d.name: d for d in [
    Device("h200-sxm", "gpu", 67e12, 989e12, 141 * GB, 700, 100,
           f"{_NV} H200 (nvidia.com/en-us/data-center/h200): FP32 67 TF, BF16 1,979 TF sparse, 141 GB, "
           "up to 700 W; idle 100 W unverified"),
    Device("h100-sxm", "gpu", 67e12, 989e12, 80 * GB, 700, 100,
           f"{_NV} H100 SXM (nvidia.com/en-us/data-center/h100): FP32 67 TF, BF16 1,979 TF sparse, 80 GB, "
           "up to 700 W; idle 100 W unverified"),
    Device("a100-sxm-80gb", "gpu", 19.5e12, 312e12, 80 * GB, 400, 60,
           f"{_NV} A100 (nvidia.com/en-us/data-center/a100): FP32 19.5 TF, BF16 312 TF dense, 80 GB, 400 W; "
           "idle 60 W unverified"),
    Device("v100-sxm2", "gpu", 15.7e12, 125e12, 32 * GB, 300, 40,
           f"{_NV} V100 (nvidia.com/en-us/data-center/v100): FP32 15.7 TF, FP16 tensor 125 TF, 32 GB, 300 W; "
           "idle 40 W unverified"),
    Device("t4", "gpu", 8.1e12, 65e12, 16 * GB, 70, 10,
           f"{_NV} T4 (nvidia.com/en-us/data-center/tesla-t4): FP32 8.1 TF, FP16 65 TF, 16 GB, 70 W; "
           "idle 10 W unverified"),
    Device("jetson-agx-orin-64gb", "edge-gpu", 5.32e12, None, 64 * GB, 60, 15,
           "Jetson AGX Orin series datasheet: 2048 Ampere CUDA cores at up to 1.3 GHz, 64 GB, 15-60 W modes; "
           "FP32 derived 2048 x 2 x 1.3 GHz; busy = 60 W mode, idle = 15 W mode"),
    Device("jetson-orin-nano-8gb", "edge-gpu", 1.28e12, None, 8 * GB, 15, 7,
           "Jetson Orin Nano series datasheet: 1024 Ampere CUDA cores, max 625 MHz, 8 GB LPDDR5, 7-15 W modes; "
           "FP32 derived 1024 x 2 x 0.625 GHz (the JetPack 6.1 'Super' clocks, 1.02 GHz / 25 W, are faster)"),
    Device("jetson-nano-4gb", "edge-gpu", 236e9, 472e9, 4 * GB, 10, 5,
           "Jetson Nano module datasheet: 128 Maxwell CUDA cores at 921.6 MHz, 472 GFLOPS FP16, 4 GB, 5/10 W modes; "
           "FP32 derived as half of FP16"),
    Device("raspberry-pi-5", "sbc", 153.6e9, None, 8 * GB, 12, 3,
           "Raspberry Pi 5 product brief: 4x Cortex-A76 at 2.4 GHz, up to 8 GB, 27 W supply; FP32 derived "
           "4 x 2.4 GHz x 16 FLOP/cycle (two 128-bit FMA pipes), unverified; busy 12 W / idle 3 W unverified"),
    Device("raspberry-pi-4", "sbc", 48e9, None, 4 * GB, 6.4, 2.7,
           "Raspberry Pi 4 Model B product brief: 4x Cortex-A72 at 1.5 GHz, 1-8 GB, 15 W supply; FP32 derived "
           "4 x 1.5 GHz x 8 FLOP/cycle, unverified; busy 6.4 W / idle 2.7 W from third-party measurements, unverified"),
    Device("xeon-8380-core", "cpu-core", 73.6e9, None, 4 * GB, 6.75, 2.0,
           "Intel Xeon Platinum 8380 (ark.intel.com): 40 cores, 2.3 GHz base, 270 W TDP, two AVX-512 FMA units; "
           "per core: FP32 derived 2.3 GHz x 32 FLOP/cycle, 270 W / 40; memory per core and idle 2 W are assumptions"),
]}


def get_device(name: str) -> Device:
    """The table entry ``name``; an unknown name lists the known ones."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {name!r}") from None
