"""moeswarm's C libraries (built by `pip install -e .` from pyproject.toml's ext-modules), found by name.

Each is plain C loaded with ctypes by the module that declares its functions (weights/qkernels.py,
transport/token_call.py); a library that was not built (no compiler at install time) is None, and
its callers take their Python paths.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path


def load(name: str) -> ctypes.CDLL | None:
    """The built library `moeswarm/<name><extension suffix>`, loaded; None when it is not there."""
    package = Path(__file__).resolve().parent  # moeswarm/
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package / f"{name}{suffix}"
        if path.is_file():
            return ctypes.CDLL(str(path))
    return None
