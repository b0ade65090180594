"""``thinwire profile``: measure on this machine what the performance model needs (imports torch; not perf/).

:func:`~thinwire.measure.run.profile_workload` returns a :class:`~thinwire.measure.file.Profile`,
saved and read back with :func:`~thinwire.measure.file.save_profile` / ``load_profile``.
"""
