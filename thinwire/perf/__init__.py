"""The performance model: small pure functions, each formula with its source, no other thinwire import.

``collectives`` (alpha-beta costs), ``timeline`` (DDP buckets and overlap), ``straggler`` (slowest
host, co-located CPU shares, noise), ``memory``, ``energy``, ``devices`` (peaks and power with
sources) and ``model`` (:func:`~thinwire.perf.model.predict_step`, which combines them).
"""
