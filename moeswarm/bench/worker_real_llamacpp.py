"""llama.cpp's own CPU time on a bench layer file, and this machine's memory bandwidth.

llama.cpp runs in a subprocess (`python -m moeswarm.bench.worker_real_llamacpp FILE THREADS
TOKENS...`, through llama-cpp-python): its mmap of the file and any crash stay out of the bench.
It times a decode of T tokens from position 0 through the one-layer model: the whole layer
(attention, router, experts) for every token, embeddings and output. The bench runs it on the real file and on a
baseline file whose experts are INNER_BASELINE wide; the difference is the experts' time.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

REPEATS = 7
BUDGET_S = 3.0  # timed decodes of one T stop after this long (at least 3 of them)


def llama_cpp_decode_seconds(path, threads: int, tokens: tuple[int, ...]) -> dict[int, tuple[float, float]] | str:
    """{T: (median wall seconds, mean CPU seconds) of one decode of T tokens} by llama.cpp, or why
    it could not be measured."""
    command = [sys.executable, "-m", "moeswarm.bench.worker_real_llamacpp", str(path), str(threads), *map(str, tokens)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
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

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            buffer.sum()
            best = min(best, time.process_time() - start)
        return buffer.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


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


def _time_decodes(path: str, threads: int, tokens: list[int]) -> dict[int, tuple[float, float]]:
    import llama_cpp
    import llama_cpp.llama_cpp as low

    from moeswarm.bench.worker_real_gguf import require_llama_cpp

    require_llama_cpp()  # silences llama.cpp's log
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
        runs = []
        model.reset()
        model.eval(ids)  # warm: pages of the file, buffers
        deadline = time.perf_counter() + BUDGET_S
        cpu = 0.0
        while len(runs) < REPEATS and (len(runs) < 3 or time.perf_counter() < deadline):
            model.reset()
            start, cpu_start = time.perf_counter(), time.process_time()
            model.eval(ids)
            runs.append(time.perf_counter() - start)
            cpu += time.process_time() - cpu_start  # every thread of this process
        times[count] = (statistics.median(runs), cpu / len(runs))
    model.close()
    return times


if __name__ == "__main__":
    file, thread_count, *counts = sys.argv[1:]
    print(json.dumps(_time_decodes(file, int(thread_count), [int(c) for c in counts])))
