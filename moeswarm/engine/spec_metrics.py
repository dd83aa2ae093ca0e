"""Speculation's Prometheus metrics, named as vLLM names its own (GET /metrics).

vllm:spec_decode_num_drafts_total                verify steps that carried drafts
vllm:spec_decode_num_draft_tokens_total          draft tokens verified (of the branches kept)
vllm:spec_decode_num_accepted_tokens_total       draft tokens accepted
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}  drafts accepted at position i (0-based)

Read at scrape time from the engine's Speculation (engine/speculation.py), whose counts only grow:
a collector in the server's registry, so nothing is added to a step.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily


class SpecCollector:
    def __init__(self, speculation):
        self.speculation = speculation

    def describe(self):
        return []  # described at collection: the per-position series grow with the longest accepted draft

    def collect(self):
        totals = self.speculation.totals
        for name, help_text, value in (
                ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", totals.drafts),
                ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", totals.drafted),
                ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", totals.accepted)):
            yield CounterMetricFamily(name, help_text, value=value)
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=["position"])
        for position, count in enumerate(list(totals.accepted_at)):
            per_position.add_metric([str(position)], count)
        yield per_position


def register_spec_metrics(metrics, speculation) -> None:
    """Add speculation's counters to `metrics`' registry (a server's ServeMetrics; nothing for a lone
    generate's unrecorded metrics)."""
    registry = vars(metrics).get("registry")  # not getattr: the unrecorded metrics answer every name
    if registry is not None:
        registry.register(SpecCollector(speculation))
