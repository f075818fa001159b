"""Benchmark scripts whose Markdown tables go into BENCHMARKS.md (not part of the test suite)."""
