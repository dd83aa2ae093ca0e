"""`moeswarm bench worker`: one `moeswarm worker` process at real models' expert dimensions.

For each layer shape (worker_real_shapes.py) and quantization type, a one-layer GGUF file
(worker_real_gguf.py, cached) is served by a real worker process hosting a quarter of the
layer's experts, then one hosting all of them. Per worker:

- start-up: from spawning the process to its "listening on" line (imports, load, ready);
- memory: VmRSS once listening (and its anonymous and file-backed parts), after the timed
  DISPATCHes, and VmHWM (peak), against the hosted quantized bytes (the file's bytes of those
  experts); through the two workers, RSS = fixed + slope x hosted bytes is solved for the slope
  (the issue's target: <= 1.25) and the fixed part;
- expert compute per token per layer at T = 1, 8, 64 tokens per DISPATCH: the median DISPATCH
  round trip over TCP on loopback minus the median idle PING round trip, over T. Each token is
  routed to top-k of the hosted experts, weights summing to 1. It includes encoding the T x d
  hidden states and decoding the outputs (~T x d x 4 bytes each way).

Next to it, llama.cpp's CPU time for the same experts (worker_real_llamacpp.py: the decode time
of the real file minus that of the baseline file with narrow experts; all-experts rows only,
llama.cpp routing over every expert) and the memory-bandwidth bound (the hosted bytes of the
distinct experts a DISPATCH touches, per token, over the measured read bandwidth).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from moeswarm_bench.bench.repeats import Repeats
from moeswarm_bench.bench.worker_process import spawn_worker
from moeswarm_bench.bench.worker_real_gguf import DEFAULT_CACHE, expert_bytes, layer_files
from moeswarm_bench.bench.worker_real_report import table_lines  # noqa: F401 (the text `bench worker` prints)
from moeswarm_bench.bench.worker_real_llamacpp import BUFFERS, llama_cpp_decode_seconds, memory_bandwidth
from moeswarm_bench.bench.worker_real_shapes import INNER_BASELINE, QUICK_SHAPE, SHAPES, TOKENS_PER_DISPATCH, LayerShape
from moeswarm.progress import progress
from moeswarm.transport.tcp import TcpLink
from moeswarm.wire.messages import Dispatch

REPLY_TIMEOUT_S = 300.0
START_TIMEOUT_S = 900.0  # a worker dequantizing a large layer on a busy 2-core machine
PINGS = 30
BUDGET_S = 4.0  # timed DISPATCHes of one T stop after this long (bench/repeats.py); --quick: a tenth

# llama.cpp's decode times: T -> ((wall s, CPU s) on the file, (wall s, CPU s) on the baseline file),
# and the buffers it ran with ("default": as it ships; "plain": without its CPU extra buffer types)
LlamaTimes = tuple[dict[int, tuple[tuple[float, float], tuple[float, float]]], str]


def run_bench_worker(models: tuple[str, ...], qtypes: tuple[str, ...], cache: Path | str | None, threads: int,
                     quick: bool = False) -> dict:
    """{meta, rows}: one row per (shape, type, hosted experts), every figure measured now; the layer files kept
    under `cache` (None: DEFAULT_CACHE)."""
    cache = Path(cache).expanduser() if cache else DEFAULT_CACHE
    shapes = [QUICK_SHAPE] if quick else [SHAPES[name] for name in models]
    bandwidth = memory_bandwidth(threads, 64 if quick else 512)
    rows = []
    with progress(desc="bench worker", total=len(shapes) * len(qtypes) * 2, unit="worker") as bar:
        for shape in shapes:
            files = layer_files(shape, qtypes, cache)
            baselines = layer_files(shape, qtypes, cache, inner=INNER_BASELINE)
            for qtype in qtypes:
                llama = _llama_cpp_experts(files[qtype], baselines[qtype], threads)
                pair = []
                for hosted in (shape.experts // 4, shape.experts):
                    pair.append(_measure_worker(shape, qtype, files[qtype], hosted, threads, bandwidth, llama,
                                                BUDGET_S / 10 if quick else BUDGET_S))
                    bar.update(1)
                _fit_memory(pair)
                rows += pair
    meta = {
        "command": "moeswarm bench worker",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.processor() or platform.machine(), "cpu": _cpu_model(), "kernels": _kernels(),
        "cpu_count": _cpu_count(), "threads": threads,
        "torch": torch.__version__, "memory_read_bandwidth_gb_s": bandwidth / 1e9, "cache_dir": str(cache),
        "carrier": "one-layer qwen3moe GGUF, random weights, quantized by llama.cpp (bench/worker_real_shapes.py)",
        "compute": "worker_us: DISPATCH round trip on loopback minus idle PING round trip, median, per token; "
                   "worker_cpu_us: the worker process's CPU time (every thread) per DISPATCH, median, per token",
        "llama_cpp": "decode time (wall, and CPU: llama_cpp_cpu_us) of the file minus that of the same layer with "
                     f"experts of {INNER_BASELINE}, per token (all experts hosted, llama.cpp's own routing)",
        "bound": "hosted bytes of the distinct experts a DISPATCH touches / memory read bandwidth, per token",
    }
    return {"meta": meta, "rows": rows}


def _measure_worker(shape: LayerShape, qtype: str, path: Path, hosted: int, threads: int, bandwidth: float,
                    llama: LlamaTimes | str, budget_s: float) -> dict:
    per_expert, types = expert_bytes(path)
    row = {"model": shape.name, "dims_of": shape.model, "type": qtype, "expert_types": types, "hidden": shape.hidden,
           "experts_in_layer": shape.experts, "inner": shape.inner, "top_k": shape.top_k, "hosted_experts": hosted,
           "hosted_bytes": hosted * per_expert, "file": str(path), "note": shape.note}
    start = time.perf_counter()
    flags = ("--threads", str(threads), "--quiet")
    with spawn_worker(str(path), range(hosted), flags, START_TIMEOUT_S) as ((host, port), process):
        row["startup_s"] = time.perf_counter() - start
        row["rss_loaded_bytes"] = _status_bytes(process.pid, "VmRSS")
        # anonymous (heap: dequantized or copied weights) vs file-backed (mapped GGUF pages) parts
        row["rss_anon_loaded_bytes"] = _status_bytes(process.pid, "RssAnon")
        row["rss_file_loaded_bytes"] = _status_bytes(process.pid, "RssFile")
        link = TcpLink(f"{host}:{port}")
        try:
            info = link.connect(_fingerprint(path))
            row["announced"] = {"hidden_size": info.hidden_size, "num_experts": info.num_experts,
                                "held": {str(layer): len(experts) for layer, experts in info.held.items()}}
            ping_s = statistics.median(link.ping(REPLY_TIMEOUT_S) for _ in range(PINGS))
            row["ping_us"] = ping_s * 1e6
            compared = llama if hosted == shape.experts else None  # llama.cpp always runs every expert
            row["per_tokens"] = [_time_tokens(link, process.pid, info, shape, count, per_expert, bandwidth, ping_s,
                                              compared, budget_s) for count in TOKENS_PER_DISPATCH]
        finally:
            link.close()
        row["rss_after_compute_bytes"] = _status_bytes(process.pid, "VmRSS")
        row["rss_peak_bytes"] = _status_bytes(process.pid, "VmHWM")
    row["rss_over_hosted"] = row["rss_loaded_bytes"] / row["hosted_bytes"]
    return row


def _time_tokens(link: TcpLink, pid: int, info, shape: LayerShape, count: int, per_expert: int, bandwidth: float,
                 ping_s: float, llama: LlamaTimes | str | None, budget_s: float) -> dict:
    request = _dispatch(info, shape, count)
    for _ in range(2):
        _round_trip(link, request)
    runs, cpu = [], []
    repeats = Repeats(budget_s, budget_s / 8)
    while repeats.more(len(runs)):
        cpu_before = _cpu_seconds(pid)
        runs.append(_round_trip(link, request))
        cpu.append(_cpu_seconds(pid) - cpu_before)  # the worker's CPU for this DISPATCH, every thread
    cpu_s = statistics.median(cpu)  # medians, as llama.cpp's (worker_real_llamacpp.py)
    touched = int(request.top_k_index.unique().numel())
    entry = {"tokens": count, "round_trip_ms": statistics.median(runs) * 1e3, "experts_touched": touched,
             "worker_us_per_token": max(statistics.median(runs) - ping_s, 0.0) / count * 1e6,
             "worker_cpu_us_per_token": cpu_s / count * 1e6,
             "bound_us_per_token": touched * per_expert / bandwidth / count * 1e6}
    if isinstance(llama, tuple):
        times, entry["llama_cpp_buffers"] = llama
        (full, full_cpu), (base, base_cpu) = times[count]
        entry["llama_cpp_layer_us_per_token"] = full / count * 1e6
        entry["llama_cpp_baseline_us_per_token"] = base / count * 1e6
        if full > base:
            entry["llama_cpp_us_per_token"] = (full - base) / count * 1e6
        if full_cpu > base_cpu:
            entry["llama_cpp_cpu_us_per_token"] = (full_cpu - base_cpu) / count * 1e6
            entry["worker_cpu_over_llama_cpp_cpu"] = cpu_s / (full_cpu - base_cpu)
    elif isinstance(llama, str):
        entry["llama_cpp_unmeasured"] = llama
    entry["worker_cpu_over_bound"] = entry["worker_cpu_us_per_token"] / entry["bound_us_per_token"]
    return entry


def _llama_cpp_experts(path: Path, baseline: Path, threads: int) -> LlamaTimes | str:
    """({T: llama.cpp's (wall, CPU) seconds for a decode of T tokens on (the file, the baseline
    file)}, its buffers), or why it was not measured. Their difference is the experts' time (none
    where noise hides it). llama.cpp runs as it ships ("default" buffers: weights repacked for the
    CPU's SIMD where it does that); only where that fails (it crashes on some AMX sandboxes) on
    "plain" buffers, which the row then says."""
    failures = []
    for buffers in BUFFERS:
        full = llama_cpp_decode_seconds(path, threads, TOKENS_PER_DISPATCH, buffers)
        base = llama_cpp_decode_seconds(baseline, threads, TOKENS_PER_DISPATCH, buffers)
        if isinstance(full, dict) and isinstance(base, dict):
            return {count: (full[count], base[count]) for count in TOKENS_PER_DISPATCH}, buffers
        failures.append(f"{buffers} buffers: {full if isinstance(full, str) else base}")
    return "; ".join(failures)


def _fit_memory(pair: list[dict]) -> None:
    """RSS = fixed + slope x hosted bytes through the quarter and all-experts workers."""
    quarter, everything = pair
    rss, hosted = (everything[k] - quarter[k] for k in ("rss_loaded_bytes", "hosted_bytes"))
    slope = rss / hosted
    fixed = quarter["rss_loaded_bytes"] - slope * quarter["hosted_bytes"]
    for row in pair:
        row["rss_slope_over_hosted"] = slope
        row["rss_fixed_bytes"] = fixed


def _dispatch(info, shape: LayerShape, count: int, seed: int = 0) -> Dispatch:
    """`count` tokens of random hidden states [T, d], each routed to top-k distinct hosted experts."""
    layer = min(info.held)
    experts = torch.tensor(info.held[layer])
    top_k = min(shape.top_k, len(experts))
    generator = torch.Generator().manual_seed(seed)
    choice = torch.rand(count, len(experts), generator=generator).argsort(dim=1)[:, :top_k]  # [T, k]
    weights = torch.rand(count, top_k, generator=generator) + 0.1  # [T, k]
    hidden = torch.randn(count, info.hidden_size, generator=generator)  # [T, d]
    return Dispatch(layer, hidden, experts[choice], weights / weights.sum(dim=1, keepdim=True))


def _round_trip(link: TcpLink, request: Dispatch) -> float:
    start = time.perf_counter()
    link.wait(link.send(link.prepare(request)), time.monotonic() + REPLY_TIMEOUT_S)
    return time.perf_counter() - start


def _fingerprint(path: Path) -> str:
    from moeswarm.gguf.gguf_file import GGUFFile

    return GGUFFile.open(path).fingerprint


def _status_bytes(pid: int, field: str) -> int:
    """A memory field of /proc/PID/status (kB there), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _cpu_seconds(pid: int) -> float:
    """CPU time of every thread of `pid` so far (the first field of each thread's schedstat, ns)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended between listing and reading
    return total / 1e9


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's word for it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernels() -> str:
    """The implementation the worker's integer kernels choose on this CPU (what its workers run)."""
    from moeswarm.kernels import qkernels

    return qkernels.isa() if qkernels.available() else "not built (experts dequantized to float32)"
