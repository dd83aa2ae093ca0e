"""Process-wide settings that only a command (never library code) may make.

Nothing here imports torch or transformers at module level: `moeswarm --help` loads neither.
"""

from __future__ import annotations

import os


def quiet_transformers() -> None:
    """No per-tensor progress bars or warnings from transformers: moeswarm prints its own lines.

    Set through the environment (an explicit value there wins), before transformers loads: no
    import here, so a command that loads no model pays nothing for it.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def set_threads(threads: int | None) -> None:
    """torch's CPU threads for this process: `threads` (at least 1), or torch's own choice when None."""
    if threads is None:
        return
    import torch  # here, not above: `moeswarm --help` must not load torch

    torch.set_num_threads(max(1, threads))
