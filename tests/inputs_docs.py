"""Valid example documents for the input-validation tests (tests/test_inputs.py, tests/test_fuzz.py)."""

from __future__ import annotations

CLUSTER = {
    "name": "lab", "defaults": {"bandwidth": "100mbit", "cpu": 1.0},
    "hosts": [{"name": "a", "group": "g1"}, {"name": "b", "group": "g2", "cpu": 0.5, "memory": "1GiB"}],
    "links": [{"between": ["g1", "g2"], "bandwidth": "50mbit", "latency": "5ms", "loss": "0.1%"}],
}

DECISION = {"name": "ring", "hosts": ["a", "b"], "shares": [4, 4], "micro": [4, 2], "codecs": ["int8", "none"],
            "predicted_step_s": 0.1}

PLAN = {
    "cluster": "lab", "cluster_fingerprint": "x", "cluster_hosts": {"a": "group g1"}, "workload": "charlm",
    "workload_fingerprint": "y", "parameters": 100, "global_batch": 8, "bucket_mb": 25.0,
    "bucket_numels": [60, 40], "chosen": DECISION, "alternatives": [DECISION],
}

PROFILE = {
    "workload": "charlm", "parameters": 100, "threads": 1,
    "compute": [{"batch": 8, "pre_s": 0.01, "forward_s": 0.02, "backward_s": 0.04, "post_s": 0.003}],
    "buckets": [{"numel": 100, "ready_frac": 1.0, "params": [0, 1], "shapes": [[10, 5], [50]]}],
    "corun_speed": {"2": 0.8}, "kernels": {"add": {"fixed_s": 0.0, "per_byte_s": 1e-10}},
    "codecs": {"int8": {"encode": {"fixed_s": 1e-5}, "decode": {"per_byte_s": 1e-10}, "ef_error": 0.01}},
    "network": {"alpha_s": 1e-4, "efficiency": 0.9, "nominal_bps": 1e8, "measured_bps": 9e7, "hosts": 2,
                "cluster": "lab"},
}

TRAIN = {"workload": "digits", "steps": 10, "lr": 1e-3, "model": {"hidden": 32}, "compression": "topk:ratio=0.01",
         "memory_budget": "512MiB", "seed": 3, "threads": 2, "timeout_s": 60.0}
