"""`moeswarm bench products`: one-row products of a real GGUF file's tensors, as a decode step makes them.

Three groups, each read from DRAM (every matrix evicted from the caches before each repeat, as a
decode step finds weights it last read a whole step ago):
  attention   every layer's attention matrices (q, k, v, output) in turn, one row each
  head        the output head, one row
  experts     one token's routed experts of layer 0 (gate, up, down of experts 0..k-1), one row
Each group runs at 1 and 2 threads, first on an idle machine, then while another process computes
(a Python loop that never sleeps): a product's median against its minimum says whether the kernels'
threads stall when they share the host (qk_pool.c). The tuning in force (kernel_tuning.py) is
reported with the figures. `--against ggml` times the same groups, one thread, against ggml's
products instead (products_ggml.py).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")


def _groups(path: str, experts: int) -> dict[str, list[tuple[int, np.ndarray, int]]]:
    """{group: [(GGUF type, [rows, row bytes] blocks, row length)]} from the file."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def matrix(tensor, data=None) -> tuple[int, np.ndarray, int]:
        data = tensor.data if data is None else data
        return int(tensor.tensor_type), np.ascontiguousarray(data), int(tensor.shape[0])

    attention = [matrix(t) for name, t in tensors.items()
                 if name.startswith("blk.") and name.split(".")[2] in ATTENTION and t.data.ndim == 2]
    routed = []
    for part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
        tensor = tensors[f"blk.0.{part}.weight"]
        routed += [matrix(tensor, tensor.data[e]) for e in range(experts)]
    return {"attention": attention, "head": [matrix(tensors["output.weight"])], "experts": routed}


def _time_group(group, threads: int) -> float:
    """Seconds of one pass over the group's matrices from DRAM, one row each."""
    from moeswarm.kernels import qkernels

    lib = qkernels._library()
    inputs = {length: torch.randn(1, length, generator=torch.Generator().manual_seed(length))
              for length in {length for _, _, length in group}}
    for _, blocks, _ in group:
        lib.qk_evict(blocks.ctypes.data, blocks.nbytes)
    start = time.perf_counter()
    for qtype, blocks, length in group:
        qkernels.matmul(qtype, blocks, length, inputs[length], threads, int8_activations=True)
    return time.perf_counter() - start


@contextlib.contextmanager
def _busy_neighbour(busy: bool) -> Iterator[None]:
    """Another process computing all the while (or nothing) inside the block."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # running before the first timing
        yield
    finally:
        spinner.kill()
        spinner.wait()


def run_products_bench(path: str, repeats: int = 30, experts: int = 8) -> dict:
    """{meta, rows}: per group, threads (1, 2) and neighbour (idle, busy): min and median ms over `repeats`."""
    from moeswarm_bench.bench.worker_real import _cpu_model
    from moeswarm.kernels import qkernels

    groups = _groups(path, experts)
    rows = []
    for busy in (False, True):
        with _busy_neighbour(busy):
            for name, group in groups.items():
                for threads in (1, 2):
                    _time_group(group, threads)  # warm-up: the pool's helpers started, the code paged in
                    times = [_time_group(group, threads) for _ in range(repeats)]
                    low, middle = min(times), statistics.median(times)
                    rows.append({"group": name, "threads": threads, "neighbour": "busy" if busy else "idle",
                                 "matrices": len(group), "min_ms": 1e3 * low, "median_ms": 1e3 * middle,
                                 "median_over_min": middle / low})
    meta = {"command": "moeswarm bench products", "file": path, "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "kernels": qkernels.isa(), "tuning": qkernels.tuning(), "repeats": repeats,
            "load_average_1min": os.getloadavg()[0], "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {"meta": meta, "rows": rows}


def table_lines(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [f"moeswarm bench products: {meta['cpu']} ({meta['cpu_count']} CPUs), kernels {meta['kernels']}, "
             f"tuning {meta['tuning']}, {meta['repeats']} repeats, load {meta['load_average_1min']:.1f}",
             f"{'group':<10} {'threads':>7} {'neighbour':>9} {'min ms':>8} {'median ms':>9} {'median/min':>10}"]
    for r in result["rows"]:
        lines.append(f"{r['group']:<10} {r['threads']:>7} {r['neighbour']:>9} {r['min_ms']:>8.3f} "
                     f"{r['median_ms']:>9.3f} {r['median_over_min']:>10.2f}")
    return lines
