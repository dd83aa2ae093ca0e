"""The kernels' speed choices (kernels/kernel_tuning.py) change no bit, are chosen per host and cached,
and the pool's waits never need a helper that is not running (qk_pool.c)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moeswarm.kernels import kernel_tuning, qkernels
from test_quant_kernels import random_rows

pytestmark = pytest.mark.skipif(not qkernels.available(), reason="moeswarm's C kernels are not built")

# (rows16_from, q6k_rows16_from): never, and each from 2 or 5 tokens on
CHOICES = list(itertools.product(kernel_tuning.PREFETCH, (1, 4, 6, 9), (0, 1), ((0, 0), (2, 5), (5, 2))))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0], ids=lambda q: q.name)
def test_every_choice_gives_the_same_bits(qtype):
    """Every prefetch, wide-tile threshold, 16-token and 16-row choice: the bits of the built-in one,
    at token counts that take every tile (1-3 narrow, 4-8 wide or narrow by the threshold, 13 and 20:
    16 and 8; Q4_K and Q6_K from 2 or 5 tokens on 16 rows side by side, or never)."""
    K = 512
    raw = random_rows(qtype, 40, K, seed=7)
    x = torch.randn(20, K, generator=torch.Generator().manual_seed(7)) * torch.logspace(-2, 2, 20)[:, None]
    before = qkernels.tuning()
    try:
        qkernels.tune(**{"prefetch": "l2", "wide_from": 4, "wide16": 1, "rows16_from": 0, "q6k_rows16_from": 0})
        reference = {n: qkernels.matmul(int(qtype), raw, K, x[:n], threads=2, int8_activations=True)
                     for n in (1, 2, 3, 4, 5, 8, 13, 20)}
        for prefetch, wide_from, wide16, (rows16_from, q6k_rows16_from) in CHOICES:
            qkernels.tune(prefetch, wide_from, wide16, rows16_from, q6k_rows16_from)
            for n, expected in reference.items():
                got = qkernels.matmul(int(qtype), raw, K, x[:n], threads=2, int8_activations=True)
                assert torch.equal(got, expected), (f"{prefetch}, wide_from={wide_from}, wide16={wide16}, rows16_from="
                                                    f"{rows16_from}, q6k_rows16_from={q6k_rows16_from}, {n} tokens")
    finally:
        qkernels.tune(before["prefetch"], before["wide_from"], before["wide16"], before["rows16_from"],
                      before["q6k_rows16_from"])


def test_a_choice_out_of_range_is_refused_and_changes_nothing():
    before = qkernels.tuning()
    with pytest.raises(ValueError, match="out of range"):
        kernel_tuning.Tuning("l2", 0, 1).apply(qkernels._library())
    with pytest.raises(ValueError, match="out of range"):
        kernel_tuning.Tuning("l2", 4, 1, 1).apply(qkernels._library())
    with pytest.raises(ValueError, match="out of range"):
        kernel_tuning.Tuning("l2", 4, 1, 2, 65).apply(qkernels._library())
    assert qkernels.tuning() == before


def test_the_environment_forces_a_choice_and_names_what_it_refuses():
    assert kernel_tuning.parse("prefetch=nta,wide16=0") == kernel_tuning.Tuning("nta", 4, 0)
    assert kernel_tuning.parse(" wide_from=6 ") == kernel_tuning.Tuning("l2", 6, 1)
    assert kernel_tuning.parse("rows16_from=0") == kernel_tuning.Tuning("l2", 4, 1, 0)
    assert kernel_tuning.parse("rows16_from=8,wide16=0") == kernel_tuning.Tuning("l2", 4, 0, 8)
    assert kernel_tuning.parse("q6k_rows16_from=0") == kernel_tuning.Tuning("l2", 4, 1, 2, 0)
    for bad in ("prefetch=t0", "wide_from=10", "wide16=2", "rows16_from=1", "rows16_from=65", "q6k_rows16_from=1",
                "speed=max"):
        with pytest.raises(ValueError, match=f"'{bad}' is not one of"):
            kernel_tuning.parse(bad)


def _tuning_in_a_child(tmp_path, setting: str | None) -> dict:
    env = {**os.environ, "MOESWARM_CACHE_DIR": str(tmp_path)}
    env.pop("MOESWARM_QK_TUNING", None)
    if setting is not None:
        env["MOESWARM_QK_TUNING"] = setting
    done = subprocess.run([sys.executable, "-c", "import json; from moeswarm.kernels import qkernels; "
                           "print(json.dumps(qkernels.tuning()))"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_measured_once_per_host_then_cached_and_forced_over_the_cache(tmp_path):
    implicit = _tuning_in_a_child(tmp_path, None)
    busy = implicit["source"] == "measured (machine busy: not cached)"  # the load average above the cores
    assert busy or implicit["source"] == "measured"
    assert (tmp_path / "kernel-tuning.json").exists() != busy
    first = _tuning_in_a_child(tmp_path, "measure")  # measured and cached, however busy
    assert first["source"] == "measured"
    cache = json.loads((tmp_path / "kernel-tuning.json").read_text())
    (key, entry), = cache.items()
    assert key.endswith(f"|{qkernels.isa()}|v{kernel_tuning.FORMAT}")
    assert entry["tuning"] == {name: first[name] for name in ("prefetch", "wide_from", "wide16", "rows16_from",
                                                               "q6k_rows16_from")}
    assert set(entry["timings_us"]["cold_one_row_us"]) == set(kernel_tuning.PREFETCH)
    assert set(entry["timings_us"]["hot_rows16_vs_not_us"]) == {str(n) for n in kernel_tuning.ROWS16_COUNTS}
    assert set(entry["timings_us"]["hot_q6k_rows16_vs_not_us"]) == {str(n) for n in kernel_tuning.ROWS16_COUNTS}
    second = _tuning_in_a_child(tmp_path, None)
    assert second["source"].startswith("cached") and second["prefetch"] == first["prefetch"]
    forced = _tuning_in_a_child(tmp_path, "prefetch=none")
    assert forced["source"].startswith("forced") and forced["prefetch"] == "none"
    assert forced["wide_from"] == first["wide_from"]  # the rest from the cache
    assert _tuning_in_a_child(tmp_path, "default")["prefetch"] == "l2"
    assert first["spin_ns"] == 0 or 2000 <= first["spin_ns"] <= 100000


def test_a_bad_environment_value_keeps_the_defaults_with_one_warning(tmp_path):
    env = {**os.environ, "MOESWARM_CACHE_DIR": str(tmp_path), "MOESWARM_QK_TUNING": "prefetch=fast"}
    done = subprocess.run([sys.executable, "-c", "import json; from moeswarm.kernels import qkernels; "
                           "print(json.dumps(qkernels.tuning()))"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["source"].startswith("default")
    assert "'prefetch=fast' is not one of" in done.stderr and "Traceback" not in done.stderr


CHILD = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from gguf import GGMLQuantizationType as Q
from moeswarm.kernels import qkernels
from test_quant_kernels import random_rows
os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})  # one CPU, as `taskset -c 0`
raw, K = random_rows(Q.Q4_K, 64, 512, seed=5), 512
x = torch.randn(6, K, generator=torch.Generator().manual_seed(5))
alone = qkernels.matmul(int(Q.Q4_K), raw, K, x, threads=1, int8_activations=True)
same = all(torch.equal(qkernels.matmul(int(Q.Q4_K), raw, K, x, threads=t, int8_activations=True), alone)
           for t in (2, 3, 4) for _ in range(200))
import threading
print(same, threading.active_count(), len(os.listdir("/proc/self/task")))
"""


def test_one_cpu_runs_every_job_on_the_calling_thread(tmp_path):
    """A process allowed one CPU starts no helper (it could only take that CPU from the caller) and
    computes the bits of one thread."""
    tests = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "MOESWARM_QK_TUNING": "default"})
    assert done.returncode == 0, done.stderr
    same, python_threads, os_threads = done.stdout.split()
    assert same == "True"
    assert int(os_threads) == int(python_threads)  # no kernel helper threads beside Python's own
