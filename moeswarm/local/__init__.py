"""Swarms on this machine: worker and stage subprocesses for the demo, the gate, benchmarks and tests."""
