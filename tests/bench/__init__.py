"""Smoke tests of the benchmarks under bench/ (run from the repository root as ``python -m bench.NAME``)."""
