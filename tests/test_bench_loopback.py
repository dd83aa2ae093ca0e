"""`moeswarm bench loopback` on the bundled model: remote against local, and the machinery per call.

The figures themselves are the benchmark's (noisy, never asserted); what is asserted is what they
are made of: every decode layer call made in C on both sides, and the machinery the layer call's
time less the worker's experts, as each RESULT said them.
"""

from __future__ import annotations

from moeswarm.bundled import demo_model
from moeswarm_bench.bench.loopback import run_loopback


def test_one_worker_s_decode_calls_are_counted_with_the_experts_time_they_took():
    result = run_loopback(str(demo_model()), workers=1, steps=4, repeats=1)
    assert result["layer_calls"] == 4 * result["moe_layers"]  # the last repetition's decode steps only
    assert result["layer_calls_in_c"] == result["layer_calls"]
    (compute_us,) = result["worker_compute_us_mean"].values()
    assert 0 < compute_us < result["layer_call_us_mean"]
    assert result["machinery_us"] == result["layer_call_us_mean"] - compute_us
