"""`moeswarm bench real`: llama.cpp and moeswarm side by side on the same Q4_K_M file, real dimensions.

Per shape (real_shapes.py; the file from real_build.py), every process is started once, one
after the other (so that each start-up is timed alone), on a file already in the page cache:
  llama.cpp   llama-cpp-python, THREADS threads, as it ships: its default buffer types (repacked
              weights where the CPU has them; real_llama.py), probed first in a child of its own;
              where they crash on this host, plain CPU buffers instead, and the row says so
  llama.cpp plain  the same on plain CPU buffers (use_extra_bufts=False), where the default runs:
              both rows reported; ratios are against the `llama.cpp` row
  local       moeswarm with the whole model in one process, THREADS torch threads
  loopback    a moeswarm backbone (THREADS threads) and 2 `moeswarm worker` processes (THREADS
              threads each), each holding half of every layer's experts, over TCP on loopback: 3
              processes on the machine's cores. Each worker stands for a machine of its own and gets
              every core: their kernels' threads rest while they wait (qk_pool.c), and a call's
              experts go to whichever thread is free, so the worker with more of a token's experts
              finishes on both cores once the other is done (less per layer call than workers of
              1 thread, whose split is rarely even: docs/measured.md, "real")
  loopback1   a backbone (THREADS threads) and one worker (1 thread) holding every expert, on
              loopback: the backbone and the worker take turns on the cores, so the layer call less
              the worker's kernels is the machinery alone, with no third process in the way (one
              thread: its kernels' CPU time, which its RESULTs say, is then their wall time)
  wan20/80    a second backbone on the same 2 workers through emulated WAN links of 20 / 80 ms RTT
A run is a 64-token prompt as one forward (prompt tokens/s) and 32 greedy decode steps, one token
each (decode tokens/s: 32 over the time of those steps). After one untimed warm-up run each, the
configurations take turns run by run, the order reversed every other repeat, so that drifting
load on a shared machine hits all alike; each figure is the median over the repeats. Then one
profiled run of local and loopback gives the decode step's time by part (real_profile.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moeswarm_bench.bench.real_build import model_file
from moeswarm_bench.bench.real_llama import N_CTX
from moeswarm_bench.bench.real_proc import Child, memory, prewarm
from moeswarm_bench.bench.real_rows import shape_rows
from moeswarm_bench.bench.real_shapes import DECODE_TOKENS, PROMPT_TOKENS, ModelShape
from moeswarm_bench.bench.worker_process import spawn_worker
from moeswarm.local.workers import split_experts
from moeswarm.progress import progress

WORKERS = 2
ALONE = "lone worker"  # loopback1's, holding every expert
WORKER_START_TIMEOUT_S = 900.0  # a worker mapping half of a 4 GB file on a busy 2-core machine
PROFILED = ("llama.cpp", "local", "loopback", "loopback1")  # llama.cpp's by its scheduler's callback


@dataclass(frozen=True)
class Config:
    name: str
    label: str
    process: str  # the role of the process that runs it
    rtt_ms: float = 0.0
    workers: tuple[str, ...] = ()  # the roles of the worker processes it uses


SPLIT = tuple(f"worker {i}" for i in range(WORKERS))


LLAMA_DEFAULT = Config("llama.cpp", "llama.cpp (llama-cpp-python, default buffer types)", "llama.cpp")
LLAMA_PLAIN = Config("llama.cpp plain", "llama.cpp (llama-cpp-python, plain buffers)", "llama.cpp plain")
LLAMA_FALLBACK = Config("llama.cpp", "llama.cpp (llama-cpp-python, plain buffers: the default crashes here)",
                        "llama.cpp plain")
CONFIGS = (
    LLAMA_DEFAULT,
    LLAMA_PLAIN,
    Config("local", "moeswarm local (one process)", "local"),
    Config("loopback", "moeswarm, 2 workers on loopback", "backbone (loopback)", workers=SPLIT),
    Config("loopback1", "moeswarm, 1 worker on loopback", "backbone (1 worker)", workers=(ALONE,)),
    Config("wan20", "moeswarm, 2 workers at 20 ms RTT", "backbone (WAN)", 20.0, SPLIT),
    Config("wan80", "moeswarm, 2 workers at 80 ms RTT", "backbone (WAN)", 80.0, SPLIT),
)


def prompt_ids(vocab: int, count: int = PROMPT_TOKENS) -> list[int]:
    """`count` token ids spread over the vocabulary (random weights: any ids do), the same every run."""
    return [(7919 * i + 11) % vocab for i in range(count)]


def configs_for(default_crash: str | None) -> tuple[Config, ...]:
    """The configurations measured: both llama.cpp rows where its default buffers run, else the plain
    one standing in as `llama.cpp` (its label says why)."""
    if default_crash is None:
        return CONFIGS
    return (LLAMA_FALLBACK, *(config for config in CONFIGS if not config.name.startswith("llama.cpp")))


def run_shape(shape: ModelShape, cache: Path, threads: int, repeats: int) -> tuple[list[dict], dict]:
    """(rows, the shape's meta) for one shape: its file built or found, every configuration measured."""
    from moeswarm_bench.bench.real_llama import probe_buffers

    path = model_file(shape, cache)
    prewarm_s = prewarm(path)
    prompt = prompt_ids(shape.vocab)
    default_crash = probe_buffers(str(path), threads)
    configs = configs_for(default_crash)
    with _processes(path, shape, threads, configs) as (children, workers):
        runs = _alternate(children, prompt, repeats, shape.name, configs)
        profiles = {name: children[name].request(op="run", prompt=prompt, decode=DECODE_TOKENS, profile=True)
                    for name in PROFILED}
        processes = [{"role": child.role, "pid": child.pid, "startup_s": child.startup_s, **memory(child.pid)}
                     for child in _unique(children.values())]
        processes += [{"role": role, "pid": pid, "startup_s": startup_s, "experts": held, "threads": count,
                       **memory(pid)} for role, pid, startup_s, held, count in workers]
        ready = {child.role: child.ready for child in _unique(children.values())}
    rows = shape_rows(shape, configs, runs, profiles, processes, threads)
    meta = {"shape": shape.name, "file": str(path), "file_bytes": path.stat().st_size, "prewarm_s": prewarm_s,
            "parameters": shape.parameters(), "ready": ready,
            "llama_cpp_default_buffers": "run" if default_crash is None else f"crash: {default_crash}"}
    return rows, meta


@contextlib.contextmanager
def _processes(path: Path, shape: ModelShape, threads: int,
               configs: tuple[Config, ...]) -> Iterator[tuple[dict[str, Child], list]]:
    """Every process of the bench, started one after another: ({config name: its child}, workers as
    (role, pid, start-up s, experts "first-last", threads))."""
    llamas = {config.process for config in configs if config.name.startswith("llama.cpp")}
    with contextlib.ExitStack() as stack, progress(desc=f"starting {shape.name}'s processes",
                                                   total=6 + len(llamas), unit="process") as bar:
        def child(role: str, module: str, args: list, env: dict | None = None) -> Child:
            started = Child(role, module, [str(a) for a in args], env)
            stack.callback(started.close)
            bar.update()
            return started

        by_role = {}
        for role in sorted(llamas):  # "llama.cpp" (default buffers), "llama.cpp plain"
            buffers = "plain" if role.endswith("plain") else "default"
            by_role[role] = child(role, "moeswarm_bench.bench.real_llama", [path, threads, N_CTX, buffers],
                                  {"OMP_NUM_THREADS": str(threads)})
        local = child("local", "moeswarm_bench.bench.real_moeswarm", [path, threads, "local"])
        workers, holders = [], {}
        for role, experts, count in [*zip(SPLIT, split_experts(shape.experts, WORKERS), [threads] * WORKERS),
                                     (ALONE, list(range(shape.experts)), 1)]:
            start = time.perf_counter()
            (host, port), process = stack.enter_context(spawn_worker(
                str(path), experts, ("--quiet",), WORKER_START_TIMEOUT_S, threads=count))
            workers.append((role, process.pid, time.perf_counter() - start, f"{experts[0]}-{experts[-1]}", count))
            holders[role] = f"{host}:{port}={process.pid}"
            bar.update()
        split = [holders[role] for role in SPLIT]
        direct = child("backbone (loopback)", "moeswarm_bench.bench.real_moeswarm", [path, threads, "direct", *split])
        alone = child("backbone (1 worker)", "moeswarm_bench.bench.real_moeswarm", [path, threads, "direct", holders[ALONE]])
        wan = child("backbone (WAN)", "moeswarm_bench.bench.real_moeswarm", [path, threads, "wan", *split])
        by_role.update({c.role: c for c in (local, direct, alone, wan)})
        yield {config.name: by_role[config.process] for config in configs}, workers


def _alternate(children: dict[str, Child], prompt: list[int], repeats: int, name: str,
               configs: tuple[Config, ...]) -> dict[str, list[dict]]:
    """{config name: its timed runs}: one warm-up run each (WAN links at 0 ms), then `repeats`
    rounds, every configuration once per round, the order reversed every other round."""
    runs: dict[str, list[dict]] = {config.name: [] for config in configs}
    total = len(configs) * (repeats + 1)
    with progress(desc=f"{name}: {repeats} alternating repeats", total=total, unit="run") as bar:
        for config in configs:
            children[config.name].request(op="run", prompt=prompt, decode=DECODE_TOKENS, rtt_ms=0.0)
            bar.update()
        for repeat in range(repeats):
            order = configs if repeat % 2 == 0 else tuple(reversed(configs))
            for config in order:
                runs[config.name].append(children[config.name].request(
                    op="run", prompt=prompt, decode=DECODE_TOKENS, rtt_ms=config.rtt_ms))
                bar.update()
    return runs


def _unique(children) -> list[Child]:
    seen: dict[int, Child] = {}
    for child in children:
        seen.setdefault(child.pid, child)
    return list(seen.values())


def run_bench_real(shapes: tuple[str, ...], cache: Path, threads: int, repeats: int, quick: bool = False) -> dict:
    """{meta, rows}: every shape's rows (real_rows.py), every figure measured now."""
    import datetime
    import platform

    import torch

    from moeswarm_bench.bench.llamacpp_convert import require_llama_cpp
    from moeswarm_bench.bench.real_shapes import QUANT_TYPE, QUICK_SHAPE, SHAPES
    from moeswarm_bench.bench.worker_real import _cpu_count, _cpu_model, _kernels

    llama_cpp = require_llama_cpp("moeswarm bench real")
    load_before = os.getloadavg()[0]  # other processes on the cores: what a shared machine adds to the noise
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    chosen = [QUICK_SHAPE] if quick else [SHAPES[name] for name in shapes]
    rows, files = [], []
    for shape in chosen:
        measured, shape_meta = run_shape(shape, cache, threads, repeats)
        rows += measured
        files.append(shape_meta)
    meta = {
        "command": "moeswarm bench real",
        "date": started,
        "machine": platform.machine(), "cpu": _cpu_model(), "cpu_count": _cpu_count(), "kernels": _kernels(),
        "torch": torch.__version__, "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_buffers": "default buffer types (as it ships) where they run on this host, probed in a child "
                             "first; plain CPU buffers (use_extra_bufts=False) beside them, and in their place "
                             "where the default crashes (each file's llama_cpp_default_buffers says which)",
        "threads": threads, "worker_threads": threads, "workers": WORKERS, "repeats": repeats,
        "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS, "quant_type": QUANT_TYPE,
        "cache_dir": str(cache), "files": files,
        "load_average_1min": {"start": load_before, "end": os.getloadavg()[0]}, "commit": _commit(),
    }
    return {"meta": meta, "rows": rows}


def _commit() -> str | None:
    """The checkout's commit ("+ changes" when its tracked files differ), or None outside a git checkout:
    the figures move with every speed change, so a report says which code it measured."""
    import subprocess

    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=root).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + (" + changes" if dirty else "")
