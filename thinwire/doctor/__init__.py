"""``thinwire doctor``: what the network costs this job, and what would help, in about a minute.

:mod:`.probe` measures on every rank (the step with and without communication, the all-reduce's
latency and bandwidth, every pair's point-to-point rate); :mod:`.advise` prices every codec and sync
mode with the performance model from those measurements and picks one; :mod:`.worker` is what runs
in each process (started by ``thinwire doctor`` through torchrun's agent, or by the user's torchrun).
"""
