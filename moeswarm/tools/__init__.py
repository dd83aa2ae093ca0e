"""Tooling outside the library's data path: benchmarks (`moeswarm bench`), the WAN emulator
(`moeswarm wan`), local worker launchers, tiny models for tests, a serve process for benchmarks."""
