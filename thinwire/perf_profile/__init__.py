"""``thinwire profile``: measure on this machine what the performance model needs (imports torch; not perf/).

:func:`~thinwire.perf_profile.run.profile_workload` returns a :class:`~thinwire.perf_profile.file.Profile`,
saved and read back with :func:`~thinwire.perf_profile.file.save_profile` / ``load_profile``.
"""
