"""`moeswarm bench products --against ggml`: moeswarm's one-row products from DRAM against ggml's, the
library llama.cpp runs (llama-cpp-python's copy), on the same file's tensors, one thread.

The groups are bench products' (attention: every layer's q, k, v, output in turn; head; one token's
8 experts of layer 0), each read from DRAM: every weight evicted from the caches before each pass.
Sides: moeswarm's kernels (the tuning in force) on the file's mapping, as moeswarm reads its weights;
the same on an anonymous copy of them (`moeswarm-anon`: one allocation, transparent huge pages where
the host gives them, as ggml's buffers are copies); ggml with its plain CPU buffers, and ggml with
each extra buffer type its CPU device offers on this host (AMX, CPU_REPACK: repacked weights,
llama.cpp's default where they run), each weight placed as llama.cpp places it (ggml_lib.py). Every side runs in
a child process of its own (`serve`), so a side that crashes (ggml's extra types do on some hosts and
types) is a row saying so, never the end of the bench. The passes alternate: each round every side
once, the order reversed every other round; figures are the minimum and median over the rounds.
Each side's products are compared with moeswarm's (max |difference| / max |moeswarm's value|): the
sides compute the same products.
"""

from __future__ import annotations

import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MOESWARM = "moeswarm"
MOESWARM_ANON = "moeswarm-anon"  # the same kernels on an anonymous copy of the weights (as ggml's buffers hold them)
REPLY_S = 300.0  # a side that has not answered a pass (or its start) in this long is reported hung
GROUPS = ("attention", "head", "experts")


def _inputs(group) -> dict[int, np.ndarray]:
    """x_K [1, K] float32 for each row length K of the group: the same on every side."""
    return {K: np.random.default_rng(K).standard_normal((1, K)).astype(np.float32)
            for K in sorted({K for _, _, K in group})}


class _MoeswarmSide:
    """One group's one-row products through moeswarm's C kernels (qk_matmul_call, one thread, int8 x)."""

    def __init__(self, group, inputs) -> None:
        from moeswarm.kernels.qk_mirrors import Matmul

        self.group, self.inputs = group, inputs  # held: the calls below point into them
        self.outputs = [np.empty(blocks.shape[0], dtype=np.float32) for _, blocks, _ in group]
        self.calls = [Matmul(qtype, blocks.ctypes.data, blocks.shape[0], K, blocks.shape[1], inputs[K].ctypes.data, 1,
                             K, y.ctypes.data, blocks.shape[0], 1, 1) for (qtype, blocks, K), y in zip(group, self.outputs)]
        self.spans = [(blocks.ctypes.data, blocks.nbytes) for _, blocks, _ in group]

    def run(self) -> None:
        from moeswarm.kernels import qkernels

        call = qkernels._library().qk_matmul_call
        for c in self.calls:
            if call(c) != 0:
                raise RuntimeError("qk_matmul_call failed")

    def results(self) -> list[np.ndarray]:
        return self.outputs


def _anonymous(group):
    """The group's matrices copied into one anonymous allocation (numpy asks for huge pages for large ones)."""
    page = 4096
    spans = [-(-blocks.nbytes // page) * page for _, blocks, _ in group]  # each copy starts on a page
    arena, out = np.empty(sum(spans) + page, dtype=np.uint8), []
    at = (page - arena.ctypes.data % page) % page
    for (qtype, blocks, K), span in zip(group, spans):
        copy = arena[at:at + blocks.nbytes].reshape(blocks.shape)
        copy[...] = blocks
        out.append((qtype, copy, K))
        at += span
    return out


def serve(path: str, side: str, experts: int) -> None:
    """A child's loop: build every group on `side`, say so (one JSON line: placement, agreement with
    moeswarm), then for each group name read from stdin time one cold pass and print its seconds."""
    from moeswarm.kernels import qkernels
    from moeswarm_bench.bench.products import _groups

    lib = qkernels._library()
    groups = _groups(path, experts)
    built, ready = {}, {"placement": {}, "max_rel_diff": {}}
    ggml = None
    if side not in (MOESWARM, MOESWARM_ANON):
        from moeswarm_bench.bench.ggml_lib import Ggml, OneRowProducts

        ggml = Ggml()
    for name, group in groups.items():
        inputs = _inputs(group)
        reference = _MoeswarmSide(group, inputs)
        reference.run()
        if side == MOESWARM:
            products, spans, counts = reference, reference.spans, {side: len(group)}
        elif side == MOESWARM_ANON:
            products = _MoeswarmSide(_anonymous(group), inputs)
            spans, counts = products.spans, {side: len(group)}
        else:
            products = OneRowProducts(ggml, group, side, inputs)
            spans, counts = products.weight_spans(), {}
            for placed in products.weights:
                counts[placed.buffer_type] = counts.get(placed.buffer_type, 0) + 1
        products.run()
        diff = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                   for a, b in zip(products.results(), reference.results()))
        built[name] = (products, spans)
        ready["placement"][name], ready["max_rel_diff"][name] = counts, diff
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        products, spans = built[line.strip()]
        for address, size in spans:
            lib.qk_evict(address, size)
        start = time.perf_counter()
        products.run()
        print(time.perf_counter() - start, flush=True)


class _Child:
    """A side's serving process: its replies read with a deadline, its death read as a status."""

    def __init__(self, path: str, side: str, experts: int) -> None:
        self.side = side
        self.stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-m", "moeswarm_bench.bench.products_ggml", path, side,
                                         str(experts)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True)
        self.failure: str | None = None

    def reply(self) -> str | None:
        """The next line, or None (self.failure says why: the signal or exit status, stderr's last line)."""
        if self.failure is None:
            ready, _, _ = select.select([self.process.stdout], [], [], REPLY_S)
            line = self.process.stdout.readline() if ready else ""
            if line:
                return line
            if not ready:
                self.process.kill()
            code = self.process.wait()
            self.stderr.seek(0)
            tail = [t for t in self.stderr.read().decode(errors="replace").splitlines() if t.strip()][-1:]
            how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}") if ready \
                else f"no answer in {REPLY_S:.0f} s"
            self.failure = how + (f": {tail[0][-200:]}" if tail else "")
        return None

    def time(self, group: str) -> float | None:
        if self.failure is not None:
            return None
        try:
            self.process.stdin.write(group + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.reply()
        return float(line) if line is not None else None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.stderr.close()


def ggml_buffer_types() -> list[str]:
    """The buffer types ggml's CPU device has here, plain first ([] without llama-cpp-python)."""
    try:
        from moeswarm_bench.bench.ggml_lib import Ggml

        return list(Ggml().buffer_types())
    except (ImportError, OSError):
        return []


def run_against_ggml(path: str, repeats: int = 30, experts: int = 8) -> dict:
    """{meta, rows}: per group and side, min and median ms of a cold one-thread pass, over `repeats` rounds."""
    from moeswarm.kernels import qkernels
    from moeswarm_bench.bench.worker_real import _cpu_model

    load_start = os.getloadavg()[0]
    sides = [MOESWARM, MOESWARM_ANON, *ggml_buffer_types()]
    children = [_Child(path, side, experts) for side in sides]
    ready = {}
    for child in children:  # every side built (read, repacked) before any pass is timed
        line = child.reply()
        ready[child.side] = json.loads(line) if line is not None else None
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for group in GROUPS:
            for r in range(repeats + 1):  # round 0: warm-up, untimed
                for child in (children if r % 2 == 0 else children[::-1]):
                    seconds = child.time(group)
                    if seconds is not None and r > 0:
                        times.setdefault((group, child.side), []).append(seconds)
    finally:
        for child in children:
            child.close()
    rows = []
    for group in GROUPS:
        base = times.get((group, MOESWARM))
        for child in children:
            found, info = times.get((group, child.side)), ready[child.side]
            row = {"group": group, "side": child.side, "status": "ok" if found else f"crashed: {child.failure}"}
            if info is not None:
                row["placement"], row["max_rel_diff"] = info["placement"][group], info["max_rel_diff"][group]
            if found:
                row.update(min_ms=1e3 * min(found), median_ms=1e3 * statistics.median(found), passes=len(found))
                if base:
                    row["min_over_moeswarm"] = min(found) / min(base)
                    row["median_over_moeswarm"] = statistics.median(found) / statistics.median(base)
            rows.append(row)
    meta = {"command": f"moeswarm bench products --against ggml --repeats {repeats}", "file": path,
            "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "kernels": qkernels.isa(), "tuning": qkernels.tuning(),
            "ggml": _ggml_version(), "repeats": repeats, "threads": 1, "load_average_1min_start": load_start,
            "load_average_1min_end": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return {"meta": meta, "rows": rows}


def _ggml_version() -> str:
    try:
        import llama_cpp

        return f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        return "llama-cpp-python missing"


def table_lines(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [f"moeswarm bench products --against ggml: {meta['cpu']} ({meta['cpu_count']} CPUs), kernels "
             f"{meta['kernels']}, {meta['ggml']}, 1 thread, weights from DRAM, {meta['repeats']} rounds, load "
             f"{meta['load_average_1min_start']:.1f} -> {meta['load_average_1min_end']:.1f}, {meta['date']}; ratio: the "
             "side's time over moeswarm's (above 1: moeswarm faster)",
             f"{'group':<10} {'side':<13} {'min ms':>8} {'median ms':>9} {'min ratio':>9} {'med ratio':>9} "
             f"{'max rel diff':>12}  placement / status"]
    for r in result["rows"]:
        if r["status"] == "ok":
            ratio = (f"{r['min_over_moeswarm']:>9.2f} {r['median_over_moeswarm']:>9.2f}" if "min_over_moeswarm" in r
                     else f"{'-':>9} {'-':>9}")
            lines.append(f"{r['group']:<10} {r['side']:<13} {r['min_ms']:>8.3f} {r['median_ms']:>9.3f} {ratio} "
                         f"{r['max_rel_diff']:>12.2e}  {r['placement']}")
        else:
            lines.append(f"{r['group']:<10} {r['side']:<13} {r['status']}")
    return lines


if __name__ == "__main__":  # a side's child: FILE SIDE EXPERTS
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
