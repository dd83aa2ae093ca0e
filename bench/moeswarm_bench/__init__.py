"""moeswarm's tooling outside the library (the moeswarm-bench distribution, bench/ in the repository):
benchmarks (`moeswarm bench`, bench/), the WAN emulator (`moeswarm wan`, wan/), their commands
(commands/, loaded by name by moeswarm/cli.py), a serve process for benchmarks and tests. The library
never imports it."""
