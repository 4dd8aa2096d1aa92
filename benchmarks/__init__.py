"""Side-by-side benchmarks of monarch_nb against raw baselines: ``python -m benchmarks``.

Kept free of imports: the raw peers import ``benchmarks.raw`` in a bare child process.
"""
