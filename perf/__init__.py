"""Benchmarks, each run from the repository root as ``python -m perf.NAME`` (``make`` targets in
docs/benchmarks.md); ``perf.benchlib`` is what they share."""
