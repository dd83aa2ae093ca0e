"""Tooling outside the library's data path: benchmarks (`moeswarm bench`), the WAN emulator
(`moeswarm wan`), their commands (tools/commands/), a serve process for benchmarks. The library never imports it."""
