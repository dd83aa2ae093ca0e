"""Process-wide settings that only a command (never library code) may make.

The imports are inside the functions so that `moeswarm --help` loads neither torch nor transformers.
"""

from __future__ import annotations


def quiet_transformers() -> None:
    """No per-tensor progress bars or warnings from transformers: moeswarm prints its own lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def set_threads(threads: int | None) -> None:
    """torch's CPU threads for this process: `threads` (at least 1), or torch's own choice when None."""
    if threads is None:
        return
    import torch

    torch.set_num_threads(max(1, threads))
