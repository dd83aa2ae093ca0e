"""The tools' commands (`moeswarm bench`, `moeswarm wan`): found by name by moeswarm/cli.py, never imported by the library."""
