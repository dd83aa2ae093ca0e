"""The C kernels' speed choices, measured on the host they run on (qkernels.c: `tuning`, `qk_tune`).

Five choices change how fast a product runs and never its bits (tests/test_kernel_tuning.py runs
each one and compares): how the next rows' weights are prefetched (none, into L2, non-temporal), from
how many tokens on the K-quants use their wide tiles, whether AVX-512's Q4_K takes 16-token tiles, and
from how many tokens on AVX512-VNNI's Q4_K and Q6_K run on 16 rows side by side (qk_q4k16.h,
qk_q6k16.h; 0: never).
Which is fastest depends on the CPU's caches and memory, not on its vendor, so at the first use of
the kernels in a process they are:
  1. forced by MOESWARM_QK_TUNING (`prefetch=none|l2|nta,wide_from=1..9,wide16=0|1,rows16_from=0|2..64,q6k_rows16_from=0|2..64`,
     any subset; the
     rest as below), or `default` (the built-in choices, nothing measured), or `measure` (measured
     again now, and cached);
  2. else read from the cache (~/.cache/moeswarm/kernel-tuning.json, MOESWARM_CACHE_DIR to move it),
     keyed by the CPU (vendor, family, model, stepping, name) and the integer kernels' instruction set;
  3. else measured now (`measure`: under a second of one thread on an idle core) and cached, unless
     the machine was busier than its cores (load average): then used for this process only, and
     measured again by the next one.
A choice wins only by a margin over the built-in one, so noise on a shared machine keeps the default.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from moeswarm.kernels.qk_mirrors import Matmul

log = logging.getLogger(__name__)

PREFETCH = ("none", "l2", "nta")  # qkernels.c's QK_PREFETCH_* in order
FORMAT = 3  # bump when the choices or their measurement change: cached choices are measured again
MARGIN = 0.97  # a choice replaces the built-in one only when it takes at most this share of its time
Q4_K, Q4_K_BLOCK_BYTES, Q4_K_BLOCK = 12, 144, 256
Q6_K, Q6_K_BLOCK_BYTES = 14, 210
ROWS, K = 2048, 2048  # a 2048 x 2048 Q4_K matrix: an attention matrix at OLMoE's width (2.4 MB)
COLD_MATRICES = 16  # read in turn, each evicted from the caches first: as a decode step reads them
REPEATS = 5
ROWS16_COUNTS = (2, 3, 4, 6, 8, 16)  # token counts the 16-rows choice is timed at


@dataclass(frozen=True)
class Tuning:
    prefetch: str = "l2"
    wide_from: int = 4
    wide16: int = 1
    rows16_from: int = 2
    q6k_rows16_from: int = 4

    def apply(self, lib) -> None:
        if lib.qk_tune(PREFETCH.index(self.prefetch), self.wide_from, self.wide16, self.rows16_from,
                       self.q6k_rows16_from) != 0:
            raise ValueError(f"kernel tuning out of range: {self}")


DEFAULT = Tuning()


def parse(text: str, base: Tuning = DEFAULT) -> Tuning:
    """`prefetch=nta,wide_from=5,wide16=0,rows16_from=4,q6k_rows16_from=0` (any subset) over `base`;
    ValueError naming what is wrong."""
    fields = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        if name == "prefetch" and value in PREFETCH:
            fields[name] = value
        elif name == "wide_from" and value.isdigit() and 1 <= int(value) <= 9:
            fields[name] = int(value)
        elif name == "wide16" and value in ("0", "1"):
            fields[name] = int(value)
        elif name in ("rows16_from", "q6k_rows16_from") and value.isdigit() and _rows16_valid(int(value)):
            fields[name] = int(value)
        else:
            raise ValueError(f"MOESWARM_QK_TUNING: {item!r} is not one of prefetch=none|l2|nta, wide_from=1..9, "
                             "wide16=0|1, rows16_from=0|2..64, q6k_rows16_from=0|2..64 (or the words default, measure)")
    return replace(base, **fields)


def cpu_key(isa: str) -> str:
    """The host's CPU as the cache knows it: vendor, family, model, stepping, name, and the kernels' ISA."""
    wanted = ("vendor_id", "cpu family", "model", "stepping", "model name")
    found: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in wanted and name not in found:
                found[name] = value.strip()
            if len(found) == len(wanted):
                break
    except OSError:
        pass
    import platform

    return "|".join([*(found.get(name, "?") for name in wanted), platform.machine(), isa, f"v{FORMAT}"])


def cache_path() -> Path:
    root = os.environ.get("MOESWARM_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "moeswarm") / "kernel-tuning.json"


def choose(lib, isa: str) -> tuple[Tuning, str]:
    """(the tuning to use, where it came from: forced, default, cached, measured) for this host."""
    forced = os.environ.get("MOESWARM_QK_TUNING", "").strip()
    if forced == "default":
        return DEFAULT, "default (MOESWARM_QK_TUNING)"
    key, path = cpu_key(isa), cache_path()
    cached = _read_cache(path).get(key)
    if forced and forced != "measure":
        base = Tuning(**cached["tuning"]) if cached else DEFAULT
        return parse(forced, base), "forced (MOESWARM_QK_TUNING)"
    if cached and forced != "measure":
        return Tuning(**cached["tuning"]), f"cached ({path})"
    busy = forced != "measure" and os.getloadavg()[0] > (os.cpu_count() or 1)
    tuning, timings = measure(lib)
    if busy:
        return tuning, "measured (machine busy: not cached)"
    _write_cache(path, key, tuning, timings)
    return tuning, "measured"


def measure(lib) -> tuple[Tuning, dict]:
    """The fastest choices on this host, one thread: prefetch on one-row products of matrices read from
    DRAM in turn; the wide tiles on products of a matrix in cache. -> (tuning, the timings in us)."""
    rng = np.random.default_rng(0)
    matrices = [_q4k_matrix(rng) for _ in range(COLD_MATRICES)]
    x = rng.standard_normal((16, K), dtype=np.float32)
    y = np.empty((16, ROWS), dtype=np.float32)
    timings: dict[str, dict] = {}

    def product(matrix: np.ndarray, n: int) -> None:
        lib.qk_matmul_call(Matmul(Q4_K, matrix.ctypes.data, ROWS, K, matrix.shape[1], x.ctypes.data, n, K,
                                  y.ctypes.data, ROWS, 1, 1))

    def cold(tuning: Tuning) -> float:
        tuning.apply(lib)
        for matrix in matrices:
            lib.qk_evict(matrix.ctypes.data, matrix.nbytes)
        start = time.perf_counter()
        for matrix in matrices:
            product(matrix, 1)
        return (time.perf_counter() - start) / len(matrices)

    def hot(tuning: Tuning, n: int, matrix: np.ndarray = matrices[0], qtype: int = Q4_K) -> float:
        tuning.apply(lib)
        call = Matmul(qtype, matrix.ctypes.data, ROWS, K, matrix.shape[1], x.ctypes.data, n, K, y.ctypes.data, ROWS, 1, 1)
        lib.qk_matmul_call(call)  # in cache
        start = time.perf_counter()
        lib.qk_matmul_call(call)
        return time.perf_counter() - start

    prefetch = {name: _best(lambda name=name: cold(replace(DEFAULT, prefetch=name))) for name in PREFETCH}
    timings["cold_one_row_us"] = {name: 1e6 * s for name, s in prefetch.items()}
    # the wide tiles timed with the 16 rows off: on, they take every Q4_K product of 2+ tokens
    chosen = replace(DEFAULT, prefetch=_winner(prefetch, DEFAULT.prefetch), rows16_from=0)
    wide = {n: (_best(lambda n=n: hot(replace(chosen, wide_from=n), n)), _best(lambda n=n: hot(replace(chosen, wide_from=9), n)))
            for n in range(4, 9)}
    timings["hot_wide_vs_narrow_us"] = {n: [1e6 * a, 1e6 * b] for n, (a, b) in wide.items()}
    wide_from = 9  # the least n from which wide tiles are not slower (by the margin) at any count up to 8
    for n in range(8, DEFAULT.wide_from - 1, -1):
        if wide[n][0] > wide[n][1] / MARGIN:
            break
        wide_from = n
    chosen = replace(chosen, wide_from=wide_from)
    sixteen = {flag: _best(lambda flag=flag: hot(replace(chosen, wide16=flag), 16)) for flag in (0, 1)}
    timings["hot_16_tokens_us"] = {str(flag): 1e6 * s for flag, s in sixteen.items()}
    chosen = replace(chosen, wide16=int(_winner({str(k): v for k, v in sixteen.items()}, str(DEFAULT.wide16))))
    rows16 = {n: (_best(lambda n=n: hot(replace(chosen, rows16_from=2), n)),
                  _best(lambda n=n: hot(replace(chosen, rows16_from=0), n))) for n in ROWS16_COUNTS}
    timings["hot_rows16_vs_not_us"] = {n: [1e6 * a, 1e6 * b] for n, (a, b) in rows16.items()}
    chosen = replace(chosen, rows16_from=_rows16_from(rows16))
    q6k = _q6k_matrix(rng)
    q6k_rows16 = {n: (_best(lambda n=n: hot(replace(chosen, q6k_rows16_from=2), n, q6k, Q6_K)),
                      _best(lambda n=n: hot(replace(chosen, q6k_rows16_from=0), n, q6k, Q6_K))) for n in ROWS16_COUNTS}
    timings["hot_q6k_rows16_vs_not_us"] = {n: [1e6 * a, 1e6 * b] for n, (a, b) in q6k_rows16.items()}
    return replace(chosen, q6k_rows16_from=_rows16_from(q6k_rows16)), timings


def _rows16_from(times: dict[int, tuple[float, float]]) -> int:
    """The least token count from which 16 rows side by side (times[n][0]) are not slower, by the margin, than
    not (times[n][1]) at any count above (0: none)."""
    rows16_from = 0
    for n in reversed(ROWS16_COUNTS):
        if times[n][0] > times[n][1] / MARGIN:
            break
        rows16_from = n
    return rows16_from


def _best(run) -> float:
    return min(run() for _ in range(REPEATS))


def _winner(times: dict[str, float], default: str) -> str:
    """The fastest choice, where it beats `default` by the margin; else `default`."""
    fastest = min(times, key=times.get)
    return fastest if times[fastest] <= MARGIN * times[default] else default


def _q4k_matrix(rng: np.random.Generator) -> np.ndarray:
    """A [ROWS, row bytes] Q4_K matrix of random quants and scales under fixed normal halves (d, dmin)."""
    blocks = rng.integers(0, 256, size=(ROWS, K // Q4_K_BLOCK, Q4_K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :, 0:4] = np.frombuffer(np.array([0.01, 0.002], dtype=np.float16).tobytes(), dtype=np.uint8)
    return np.ascontiguousarray(blocks.reshape(ROWS, -1))


def _q6k_matrix(rng: np.random.Generator) -> np.ndarray:
    """A [ROWS, row bytes] Q6_K matrix of random quants and scales under a fixed normal half (d)."""
    blocks = rng.integers(0, 256, size=(ROWS, K // Q4_K_BLOCK, Q6_K_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :, 208:210] = np.frombuffer(np.array([0.001], dtype=np.float16).tobytes(), dtype=np.uint8)
    return np.ascontiguousarray(blocks.reshape(ROWS, -1))


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {key: value for key, value in data.items()
            if isinstance(value, dict) and isinstance(value.get("tuning"), dict) and _valid(value["tuning"])}


def _valid(fields: dict) -> bool:
    try:
        tuning = Tuning(**fields)
    except TypeError:
        return False
    return (tuning.prefetch in PREFETCH and tuning.wide_from in range(1, 10) and tuning.wide16 in (0, 1)
            and isinstance(tuning.rows16_from, int) and _rows16_valid(tuning.rows16_from)
            and isinstance(tuning.q6k_rows16_from, int) and _rows16_valid(tuning.q6k_rows16_from))


def _rows16_valid(value: int) -> bool:
    return value == 0 or 2 <= value <= 64


def _write_cache(path: Path, key: str, tuning: Tuning, timings: dict) -> None:
    """Add this host's entry (atomically: a rename; concurrent first uses each write a whole file)."""
    data = _read_cache(path)
    data[key] = {"tuning": asdict(tuning), "timings_us": timings, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                                time.gmtime())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        partial.write_text(json.dumps(data, indent=1) + "\n")
        partial.replace(path)
    except OSError as error:
        log.info("kernel tuning not cached (%s): measured again in the next process", error)
