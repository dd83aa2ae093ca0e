"""Process-wide settings that only a command (never library code) may make.

Nothing here imports torch or transformers at module level: `moeswarm --help` loads neither.
"""

from __future__ import annotations

import os
import sys


def quiet_transformers() -> None:
    """No per-tensor progress bars or warnings from transformers: moeswarm prints its own lines.

    Set through the environment (an explicit value there wins), before transformers loads: no
    import here, so a command that loads no model pays nothing for it.
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def set_threads(threads: int | None) -> int:
    """Set torch's CPU threads for this process: `threads` (at least 1), or `default_threads()` when None."""
    import torch

    chosen = max(1, threads) if threads is not None else default_threads()
    torch.set_num_threads(chosen)
    return chosen


def set_backbone_threads(threads: int | None) -> int:
    """Set a backbone's torch and kernel threads: `threads`, or every core this process may run on.

    A backbone and its workers take turns: the backbone waits while a layer's trip is out, the
    workers wait while it computes attention and the head. So the backbone gets every core even
    when workers share the machine (docs/measured.md, "threads"). Idle threads do not spin:
    OMP_WAIT_POLICY=PASSIVE (cli.py), and the kernels' pool sleeps after a short spin (qk_pool.c).
    """
    return set_threads(threads if threads is not None else _cores())


SWITCH_INTERVAL_S = 0.0005


def set_switch_interval() -> None:
    """For `serve`, at its entry: a step's forwards (a thread per group, or per sequence) take turns on
    the GIL at every torch op, and a thread back from one waits for the holder's switch interval
    (5 ms by default) before it may run again. It is the whole process's setting, so only a command sets it."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_threads() -> int:
    """This process's share of the cores it may run on: those cores over the moeswarm processes on them.

    torch's own default takes every core, in every process: a backbone and two workers on a
    2-core machine ran 6 busy threads on 2 cores. Counting the moeswarm processes already running
    (this one included) shares the cores instead; a process alone on a machine still gets them all.
    """
    return max(1, _cores() // moeswarm_processes())


def moeswarm_processes() -> int:
    """moeswarm processes running on this machine (`moeswarm ...` or `python -m moeswarm.cli ...`), at least this one."""
    import psutil

    others = 0
    found = {p.info["pid"]: p.info for p in psutil.process_iter(["pid", "ppid", "cmdline"])}
    for info in found.values():
        cmdline = info.get("cmdline") or []
        forked = found.get(info.get("ppid"), {}).get("cmdline") == cmdline  # a helper process (a DHT node): no torch work
        if info["pid"] != os.getpid() and not forked and any(
                os.path.basename(arg) == "moeswarm" or arg == "moeswarm.cli" for arg in cmdline[:3]):
            others += 1
    return others + 1


def add_quiet(parser) -> None:
    """The `--quiet` flag of a command with long operations; its run calls `quiet_progress(args)`."""
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars on stderr (they are only drawn when stderr is a terminal)")


def quiet_progress(args) -> None:
    """Apply a command's `--quiet` (absent on a subcommand without it: bars stay on)."""
    from moeswarm.progress import set_quiet

    set_quiet(getattr(args, "quiet", False))


def add_backbone_dtype(parser) -> None:
    """`--backbone-dtype`: a GGUF backbone's matrices in the file's encoding (file) or as float32 (f32)."""
    parser.add_argument("--backbone-dtype", choices=("file", "f32"), default="file",
                        help="GGUF files: keep non-expert matrices in the file's 16-bit or quantized encoding (file, "
                             "the default) or dequantize them to float32 (f32); the --check-local reference follows "
                             "the same choice")
