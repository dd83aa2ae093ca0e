"""What `moeswarm info` says of a model: its summary (summary.py), and for a GGUF file the
architecture's support status (gguf/gguf_support.py) and the gate to run before serving it over
a lossy wire."""

from __future__ import annotations

import shlex
from pathlib import Path

from moeswarm.sources.summary import summarize, summary_lines
from moeswarm.gguf.gguf_file import GGUFFile
from moeswarm.gguf.gguf_support import support_status

__all__ = ["describe_model", "gguf_support_info", "summary_lines"]  # summary_lines: the text of a description

# The lossy wire the gate command checks: blockwise 8-bit both ways, one sum per worker.
GATE_WIRE = ("--combine", "partial", "--wire-dispatch", "int8-b128", "--wire-combine", "int8-b128")


def describe_model(path: str | Path, workers: int = 2) -> dict:
    """summarize(path, workers), with gguf_support_info for a GGUF file."""
    info = summarize(path, workers)
    if info["kind"] == "gguf":
        info.update(gguf_support_info(info["path"]))
    return info


def gguf_support_info(path: str) -> dict:
    """The GGUF architecture, its support line, and the gate command for the file at `path`."""
    arch = GGUFFile.open(path).arch
    _, status = support_status(arch)
    return {"gguf_architecture": arch, "gguf_support": status,
            "gate_command": shlex.join(["moeswarm", "gate", "--model", path, *GATE_WIRE])}
