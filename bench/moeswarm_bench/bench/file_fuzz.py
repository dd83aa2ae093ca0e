"""`moeswarm bench fuzz --files N`: mutated GGUF files through `info`, `slice`, `worker` and `generate`.

Each file is the bundled model's Q4_K_M export (or `--model`) with one mutation
(moeswarm_bench/bench/file_mutations.py, seeded). Every command runs in a forked child
(moeswarm_bench/bench/forked_run.py) under a deadline and an RSS cap; a worker that prints "listening on"
accepted the file and is stopped. Counted per command: refused (exit 2, one line), ok/started,
and the findings: crash (a signal), hang (past the deadline), memory (RSS past the cap),
traceback, bad-exit (another status, or more than one line).
"""

from __future__ import annotations

import random
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from moeswarm_bench.bench.file_mutations import Layout, mutate
from moeswarm_bench.bench.forked_run import RunResult, run_forked

FINDINGS = ("crash", "hang", "memory", "traceback", "bad-exit")
COMMANDS = ("info", "slice", "worker", "generate")
TIMEOUT_S = 60.0
RSS_CAP_MB = 3000.0
EXPERTS = "0-7"


def default_model() -> Path:
    from moeswarm.bundled import PYMOE

    return PYMOE / "gguf" / "pymoe-Q4_K_M.gguf"


def command_argv(command: str, path: str, out_dir: str) -> list[str]:
    """The argv (after `moeswarm`) that gives `path` to `command`."""
    if command == "info":
        return ["info", path]
    if command == "slice":
        return ["slice", path, "--experts", EXPERTS, "-o", f"{out_dir}/part.gguf", "--quiet"]
    if command == "worker":
        return ["worker", "--model", path, "--experts", EXPERTS, "--port", "0", "--threads", "1", "--quiet"]
    return ["generate", "--model", path, "--prompt", "def f(x):", "--max-new-tokens", "2", "--threads", "1", "--quiet"]


def run_file_fuzz(files: int = 200, seed: int = 0, model: str | None = None, commands: tuple[str, ...] = COMMANDS,
                  timeout_s: float = TIMEOUT_S, rss_cap_mb: float = RSS_CAP_MB,
                  progress: Callable[[int, dict], None] | None = None) -> dict:
    """Fuzz the commands with `files` mutated files; the counts, the peak RSS and the findings' cases."""
    _warm_imports()
    base_path = Path(model) if model else default_model()
    base = base_path.read_bytes()
    layout = Layout(base)
    rng = random.Random(seed)
    counts = {command: Counter() for command in commands}
    findings, peak, slowest = [], 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/mutant.gguf"
        for index in range(files):
            data, what = mutate(base, layout, rng)
            Path(path).write_bytes(data)
            for command in commands:
                result = run_forked(command_argv(command, path, tmp), timeout_s, rss_cap_mb, listening=command == "worker")
                counts[command][result.outcome] += 1
                peak, slowest = max(peak, result.peak_rss_mb), max(slowest, result.seconds)
                if result.outcome in FINDINGS:
                    findings.append(_finding(index, what, command, result))
            if progress is not None and (index + 1) % 25 == 0:
                progress(index + 1, _totals(counts))
    return {"model": str(base_path), "files": files, "seed": seed, "runs": files * len(commands),
            "counts": {command: dict(counter) for command, counter in counts.items()},
            "findings": _totals(counts), "peak_rss_mb": round(peak, 1), "slowest_run_s": round(slowest, 2),
            "timeout_s": timeout_s, "rss_cap_mb": rss_cap_mb, "cases": findings[:50]}


def _warm_imports() -> None:
    """Import here, once, what every run would import: each forked child then starts warm."""
    import importlib

    import torch

    torch.set_num_threads(1)
    for name in ("moeswarm.cli", "moeswarm.commands.info", "moeswarm.commands.slice", "moeswarm.commands.worker",
                 "moeswarm.commands.generate", "moeswarm.sources.describe", "moeswarm.sources.loading",
                 "moeswarm.sources.gguf_source", "moeswarm.gguf.gguf_slice", "moeswarm.worker.server",
                 "transformers.models.qwen2_moe.modeling_qwen2_moe", "tokenizers"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _totals(counts: dict[str, Counter]) -> dict[str, int]:
    return {kind: sum(c[kind] for c in counts.values()) for kind in FINDINGS if any(c[kind] for c in counts.values())}


def _finding(index: int, what: str, command: str, result: RunResult) -> dict:
    tail = [line for line in result.stderr.splitlines() if line.strip()][-3:]
    return {"file": index, "mutation": what, "command": command, "outcome": result.outcome,
            "seconds": round(result.seconds, 2), "stderr_tail": tail}
