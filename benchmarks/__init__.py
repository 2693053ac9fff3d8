"""Benchmark scripts (run as `python benchmarks/<name>.py --help`); shared pieces live in common.py."""
