"""Handing freed memory back to the system once a connection that held large buffers is gone.

glibc serves large allocations from mmap only up to a threshold it raises after each large free
(up to 32 MiB on 64-bit): after a few big frames, later ones come from the heap, and freeing
them leaves the pages with the process. A worker that served a flood of large requests would
keep that memory after the connections closed. `malloc_trim(0)` returns free heap pages (also
from the middle of the heap, glibc >= 2.8); elsewhere this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """Return the allocator's free pages to the system (glibc); nothing elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
