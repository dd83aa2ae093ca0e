"""Any holder serves any span (issue 59, item 4): stages use workers that hold experts of every
layer, more than their spans, and the chain stays bit-identical to the model run locally."""

from __future__ import annotations

import json
import subprocess
import sys

from moeswarm.local.stages import local_stages
from moeswarm.local.workers import local_workers

MODEL = "models/pymoe/hf"  # 6 decoder layers, 32 experts


def test_stages_share_workers_that_hold_every_layer():
    with local_workers(MODEL, [list(range(16)), list(range(16, 32))]) as workers, \
            local_stages(MODEL, ["0-3", "4-5"], workers=[workers, workers]) as stages:
        result = subprocess.run([sys.executable, "-m", "moeswarm.cli", "generate", "--model", MODEL, "--prompt",
                                 "def main(", "--json", "--check-local", "--threads", "1", "--max-new-tokens", "8",
                                 "--stages", ",".join(stages)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["bit_identical"] is True
