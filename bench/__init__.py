"""Benchmarks: suites of frozen cases, a thin CLI, results as CSV/markdown/plots."""
