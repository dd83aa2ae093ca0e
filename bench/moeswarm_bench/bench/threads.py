"""The benches' torch thread count for one measurement, put back after it."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's CPU threads at `threads` inside the block, then what they were."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
