"""A network namespace for tests: a member that can dial out but cannot be dialled.

Test modules import it as `netns` (pytest puts tests/ on sys.path, as for swarm_processes) and use
its `namespace` fixture. Making one needs root and `ip netns`; elsewhere the test is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


class Namespace:
    """A network namespace joined to this one by a veth pair: 10.200.N.1 here, 10.200.N.2 there, and
    10.201.N.2 on the namespace's loopback, which nothing here routes to."""

    def __init__(self):
        n = os.getpid() % 200 + 1
        self.name, self.here_if, self.there_if = f"msrelay{n}", f"msrh{n}", f"msrn{n}"
        self.here, self.inside = f"10.200.{n}.1", f"10.201.{n}.2"
        self._steps = [
            ["ip", "netns", "add", self.name],
            ["ip", "link", "add", self.here_if, "type", "veth", "peer", "name", self.there_if],
            ["ip", "link", "set", self.there_if, "netns", self.name],
            ["ip", "addr", "add", f"{self.here}/24", "dev", self.here_if],
            ["ip", "link", "set", self.here_if, "up"],
            ["ip", "-n", self.name, "addr", "add", f"10.200.{n}.2/24", "dev", self.there_if],
            ["ip", "-n", self.name, "link", "set", self.there_if, "up"],
            ["ip", "-n", self.name, "link", "set", "lo", "up"],
            ["ip", "-n", self.name, "addr", "add", f"{self.inside}/32", "dev", "lo"],
        ]

    def create(self) -> None:
        self.delete()  # left by a run that was killed
        for step in self._steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                self.delete()
                pytest.skip(f"cannot make a network namespace here ({' '.join(step)}: {done.stderr.strip()})")

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.here_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


@pytest.fixture
def namespace():
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs `ip netns` and root to make a network namespace")
    made = Namespace()
    made.create()
    yield made
    made.delete()


def inside(namespace: Namespace, *args: str) -> subprocess.Popen:
    """`python -m moeswarm.cli ARGS` run inside the namespace, its stdout and stderr piped as text."""
    return subprocess.Popen(["ip", "netns", "exec", namespace.name, sys.executable, "-m", "moeswarm.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
