"""llama.cpp's own CPU time on a bench layer file, and this machine's memory bandwidth.

llama.cpp runs in a subprocess (`python -m moeswarm_bench.bench.worker_real_llamacpp FILE THREADS
BUFFERS TOKENS...`, through llama-cpp-python): its mmap of the file and any crash stay out of the
bench. BUFFERS is "default" (llama.cpp as it ships: its CPU "extra buffer types", repacked weights
or AMX tiles where the CPU has them) or "plain" (without them: see `plain_cpu_buffers`).
It times a decode of T tokens from position 0 through the one-layer model: the whole layer
(attention, router, experts) for every token, embeddings and output. The bench runs it on the real file and on a
baseline file whose experts are INNER_BASELINE wide; the difference is the experts' time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from moeswarm_bench.bench.threads import torch_threads

BUDGET_S = 3.0  # timed decodes of one T stop after this long (bench/repeats.py)


BUFFERS = ("default", "plain")


def llama_cpp_decode_seconds(path, threads: int, tokens: tuple[int, ...],
                             buffers: str = "default") -> dict[int, tuple[float, float]] | str:
    """{T: (median wall seconds, median CPU seconds) of one decode of T tokens} by llama.cpp with
    `buffers` (one of BUFFERS), or why it could not be measured."""
    assert buffers in BUFFERS
    command = [sys.executable, "-m", "moeswarm_bench.bench.worker_real_llamacpp", str(path), str(threads), buffers,
               *map(str, tokens)]
    # OpenMP's team is the thread count: by default it is every core, and threads of a team that
    # llama.cpp leaves idle spin, counted as its CPU time (docs/measured.md, "llama.cpp").
    environment = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    except subprocess.TimeoutExpired:
        return "llama.cpp did not finish within 600 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return f"llama.cpp failed: {last[:200]}"
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    return {int(t): (float(wall), float(cpu)) for t, (wall, cpu) in measured.items()}


def memory_bandwidth(threads: int, megabytes: int = 512) -> float:
    """Bytes/s read by a sum over a buffer far larger than any cache, with `threads` torch threads
    (best of 5, over the process's CPU time: other processes' turns on a shared core do not count)."""
    import torch

    with torch_threads(threads):
        buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            buffer.sum()
            best = min(best, time.process_time() - start)
        return buffer.numel() * 4 / best


def plain_cpu_buffers(default):
    """llama.cpp's model parameters `default()` without its CPU "extra buffer types" (AMX tiles,
    repacked weights): a native build of llama-cpp-python segfaults in its first Q8_0 or Q4_K_M eval
    with them on AMX-capable Xeons in a sandbox (this project's machines), and runs without them.
    `Llama` does not take the parameter, so callers put this in place of
    `llama_cpp.llama_cpp.llama_model_default_params` while a model loads."""

    def params():
        value = default()
        value.use_extra_bufts = False
        return value

    return params


def _time_decodes(path: str, threads: int, buffers: str, tokens: list[int]) -> dict[int, tuple[float, float]]:
    import llama_cpp
    import llama_cpp.llama_cpp as low

    from moeswarm_bench.bench.repeats import Repeats
    from moeswarm_bench.bench.worker_real_gguf import require_llama_cpp

    require_llama_cpp()  # silences llama.cpp's log
    if buffers == "plain":
        low.llama_model_default_params = plain_cpu_buffers(low.llama_model_default_params)
    batch = max(tokens)
    # logits_all: llama.cpp drops the rows whose logits nobody asked for before the last layer's
    # FFN; in a one-layer model that would leave one token of T for the experts.
    model = llama_cpp.Llama(path, n_ctx=max(256, 2 * batch), n_batch=batch, n_ubatch=batch, n_threads=threads,
                            n_threads_batch=threads, use_mmap=True, logits_all=True, verbose=False)
    vocab = model.n_vocab()
    times = {}
    for count in tokens:
        ids = [(7 * i + 3) % (vocab - 1) for i in range(count)]
        runs, cpu = [], []
        model.reset()
        model.eval(ids)  # warm: pages of the file, buffers
        repeats = Repeats(BUDGET_S)
        while repeats.more(len(runs)):
            model.reset()
            start, cpu_start = time.perf_counter(), time.process_time()
            model.eval(ids)
            runs.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)  # every thread of this process
        # medians: one decode that another process's turn stretched (or a thread's spin) moves neither
        times[count] = (statistics.median(runs), statistics.median(cpu))
    model.close()
    return times


if __name__ == "__main__":
    file, thread_count, buffer_types, *counts = sys.argv[1:]
    print(json.dumps(_time_decodes(file, int(thread_count), buffer_types, [int(c) for c in counts])))
