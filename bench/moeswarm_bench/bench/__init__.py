"""Benchmarks: each measures side by side in one run and returns plain rows (JSON-ready)."""
