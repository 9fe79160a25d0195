"""The ``kvcore`` command line: a driving adapter (demo, benchmarks, config checks), not part of the core."""
