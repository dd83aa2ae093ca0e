"""moeswarm's C libraries (built by `pip install -e .` from pyproject.toml's ext-modules), found by name.

Each is plain C loaded with ctypes by the module that declares its functions (kernels/qk_library.py,
transport/token_call.py); a library that was not built (no compiler at install time) is None, and
its callers take their Python paths. A library that was built from other sources than the Python
loading it (its report of struct layouts and constants, `check_layout`) is refused.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
from pathlib import Path

from moeswarm.errors import MoeSwarmError


def load(name: str) -> ctypes.CDLL | None:
    """The built library `moeswarm/<name><extension suffix>`, loaded; None when it is not there."""
    package = Path(__file__).resolve().parent  # moeswarm/
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package / f"{name}{suffix}"
        if path.is_file():
            return ctypes.CDLL(str(path))
    return None


class _Entry(ctypes.Structure):
    """One line of a library's layout report (moeswarm/native.h MswLayoutEntry)."""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_int64)]


def reported(lib: ctypes.CDLL, function: str) -> dict[str, int]:
    """The layout a library reports about itself (`function`: native.h's table, ended by a NULL name)."""
    report = getattr(lib, function)
    report.argtypes, report.restype = [], ctypes.POINTER(_Entry)
    table, out, i = report(), {}, 0
    while table[i].name is not None:
        out[table[i].name.decode()] = table[i].value
        i += 1
    return out


def check_layout(name: str, report: dict[str, int], mirrors: dict[str, type[ctypes.Structure]],
                 constants: dict[str, int]) -> None:
    """Refuse library `name` unless its report (`reported`) is what Python has: each C struct's size
    and field offsets those of its ctypes mirror (mirrors: C name -> Structure), each constant
    Python's. A MoeSwarmError names the first field that disagrees (offsets before sizes)."""
    expected = dict(constants)
    for c_name, mirror in mirrors.items():
        expected[c_name] = ctypes.sizeof(mirror)
        expected.update({f"{c_name}.{field[0]}": getattr(mirror, field[0]).offset for field in mirror._fields_})
    names = [*report, *(key for key in expected if key not in report)]  # the library's order first
    for key in sorted(names, key=lambda key: "." not in key):
        if key not in expected:
            problem = f"{key} is {report[key]} in C and missing from Python's mirror"
        elif key not in report:
            problem = f"{key} is {expected[key]} in Python and not reported by the library"
        elif report[key] != expected[key]:
            problem = f"{key} is {report[key]} in C and {expected[key]} in Python"
        else:
            continue
        raise MoeSwarmError(f"refusing moeswarm/{name}: {problem} (a stale build? rebuild with `pip install -e .`)")
