"""Real `moeswarm` processes of a swarm made from an invite, for tests: the inviter, joiners, their lines.

Test modules import it as `swarm_processes` (pytest puts tests/ on sys.path, as for llamacpp_fixtures).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeswarm.bundled import PYMOE
from moeswarm.ids import parse_experts

WAIT_S = 180.0


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`moeswarm ARGS` started, its output piped; `env`: variables set for it on top of this process's."""
    return subprocess.Popen([sys.executable, "-m", "moeswarm.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def run(*args: str, timeout: float = WAIT_S, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`moeswarm ARGS` to its end; `env`: variables set for it on top of this process's."""
    return subprocess.run([sys.executable, "-m", "moeswarm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def lines_until(process: subprocess.Popen, marker: str, wait_s: float = WAIT_S) -> list[str]:
    """Standard output's lines up to the first holding `marker` (fails if the process ends first)."""
    lines, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"process ended before {marker!r}: {''.join(lines)} {process.stderr.read()[-3000:]}")
        lines.append(line)
        if marker in line:
            return lines
    pytest.fail(f"no {marker!r} within {wait_s:g} s")


def bundled_copy(directory: Path) -> Path:
    model = directory / "pymoe.gguf"
    shutil.copy(PYMOE / "gguf" / "pymoe-Q4_K_M.gguf", model)
    return model


def join(invite: str, directory: Path, experts: int, manifest, *flags: str) -> subprocess.Popen:
    """`moeswarm join` with memory for `experts` experts."""
    memory_gb = (experts + 0.5) * manifest.expert_bytes() / 1e9
    return cli("join", invite, "--memory", f"{memory_gb:.9f}", "--dir", str(directory), "--threads", "1", *flags)


def share_of(lines: list[str]) -> list[int]:
    line = next(line for line in lines if "share: experts " in line)
    return parse_experts(line.split("share: experts ", 1)[1].split()[0])


def announced(lines: list[str]) -> str:
    line = next(line for line in lines if "announced on the swarm as " in line)
    return line.split("announced on the swarm as ", 1)[1].split()[0]


def status(invite: str, directory: Path) -> dict:
    result = run("status", invite, "--dir", str(directory), "--json", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)
