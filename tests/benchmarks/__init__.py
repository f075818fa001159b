"""Smoke tests of the benchmark scripts (tests/conftest.py selects Triton's CPU interpreter without a GPU)."""
