"""Scoring a plan without a network: replay rows through the per-call chooser. Pure.

Each row is one decode token's top-k at one layer, sent as its own star call: the chooser
(placement/chooser.py `choose_for_call`, the dispatcher's own rule) picks its holders from the
plan's table and the workers' nominal RTTs; the call reaches those workers and lasts as long as
the slowest of their RTTs. What it leaves out: compute, bandwidth, the machinery's fixed cost
per call (docs/bench.md measures those), and batching (a step of several tokens reaches the
union of their workers).

Legend: T = rows, k = router top-k.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping

import torch

from moeswarm.ids import WorkerId
from moeswarm.placement.chooser import choose_for_call
from moeswarm.placement.plan_file import Plan
from moeswarm.placement.table import build_table


def simulate(plan: Plan, rows: Mapping[int, torch.Tensor]) -> dict:
    """rows {layer: [T, k] long}: workers reached per token-layer and the mean layer-call time (ms)
    the plan's RTTs give, overall and per layer."""
    table = build_table({WorkerId(i): held for i, held in plan.held().items()}, plan.num_experts)
    rtt_s = [w.spec.rtt_ms / 1e3 for w in plan.workers]
    reached_all, ms_all, per_layer = [], [], {}
    for layer, index in sorted(rows.items()):
        reached, ms = [], []
        for row in index.tolist():  # one [k] row: one token's experts
            experts = sorted({e for e in row if e >= 0})
            owner = choose_for_call(table, layer, experts, rtt_s)  # [E]
            if (owner[experts] < 0).any():
                missing = [e for e in experts if owner[e] < 0]
                raise ValueError(f"the plan holds no copy of layer {layer} experts {missing}")
            workers = set(owner[experts].tolist())
            reached.append(len(workers))
            ms.append(max(plan.workers[w].spec.rtt_ms for w in workers))
        per_layer[layer] = {"workers_per_token": statistics.fmean(reached), "layer_call_ms": statistics.fmean(ms)}
        reached_all += reached
        ms_all += ms
    return {"rows": len(ms_all), "workers_per_token_layer": statistics.fmean(reached_all),
            "layer_call_ms": statistics.fmean(ms_all), "layers": per_layer}
