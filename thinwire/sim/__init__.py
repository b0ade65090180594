"""The simulator: a cluster spec, a profile and a codec, turned into perf/'s plain inputs and priced.

:mod:`.inputs` (spec/profile/codec to model inputs), :mod:`.sweep` (host counts, energy, memory),
:mod:`.output` (table, JSON, PNGs), :mod:`.validate` (the same configurations run for real).
"""
