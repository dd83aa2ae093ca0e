"""Float products give the same bits at any thread count (moeswarm/__init__.py: MKL's strict
reproducibility): stages, workers and the local reference may run on machines with other cores."""

from __future__ import annotations

import subprocess
import sys

# Rows 1-39 of a few matrices, each product at 1 and at 2 threads, in a fresh process that imports
# moeswarm before it computes anything (as every moeswarm command does). Without the mode, 30 of
# these 195 products differ between 1 and 2 threads on this project's machines.
_PRODUCTS = """
import moeswarm, torch, torch.nn.functional as F
torch.manual_seed(0)
differ = 0
for rows in range(1, 40):
    for inner, outer in ((128, 128), (128, 512), (64, 128), (128, 64), (2048, 2048)):
        x, w, b = torch.randn(rows, inner), torch.randn(outer, inner), torch.randn(outer)
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(F.linear(x, w, b))
        differ += not torch.equal(*results)
print(differ)
"""


def test_float_products_do_not_depend_on_the_thread_count():
    run = subprocess.run([sys.executable, "-c", _PRODUCTS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["0"]
