"""Handing freed memory back to the system once a connection that held large buffers is gone.

glibc serves large allocations from mmap only up to a threshold it raises after each large free
(up to 32 MiB on 64-bit): after a few big frames, later ones come from the heap, and freeing
them leaves the pages with the process. A worker that served a flood of large requests would
keep that memory after the connections closed. `malloc_trim(0)` returns free heap pages (also
from the middle of the heap, glibc >= 2.8); elsewhere this is a no-op.

`serve_large_from_mmap` fixes that threshold instead (glibc's `mallopt(M_MMAP_THRESHOLD)`, which
also turns its raising off): request bodies, reply buffers and the experts' large intermediates
then come from mmap and go back to the system when freed, so what a flood of large requests
makes the worker hold is what it holds at that moment, not the heap's high-water mark.
Allocations below it (a decode step's tensors) are served from the heap as before.
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


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


@functools.cache
def _mallopt():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def serve_large_from_mmap(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve allocations of `threshold` bytes and more from mmap from now on (glibc); False elsewhere."""
    mallopt = _mallopt()
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold))


def release_freed_memory() -> None:
    """Return the allocator's free pages to the system (glibc); nothing elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
