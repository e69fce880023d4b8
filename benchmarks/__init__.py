"""Benchmarks: run with `python -m benchmarks.<name>`; each writes JSON and appends to RESULTS.md."""
