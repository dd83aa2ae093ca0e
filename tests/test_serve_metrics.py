"""/metrics under vLLM's names, parsed with prometheus_client's own parser, against a real serve on
the bundled model and two workers: each latency histogram counts a request once its end is known,
buckets reach 2,560 s, time to first token is measured from arrival (never more than the whole
request), a finish-reason counter, and request gauges that drop as soon as a client goes away."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
              "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
              "vllm:request_inference_time_seconds")


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of GET /metrics: {(sample name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "pymoe", **labels}.items()))), 0.0)


def test_a_request_is_measured_by_vllm_histograms(trained_serve):
    url = trained_serve.url
    before = _samples(url)
    body = {"model": "pymoe", "prompt": "def add(a, b):\n", "max_tokens": 6, "temperature": 0, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        events = [line for line in reply.iter_lines() if line.startswith("data: ")]
    took = time.monotonic() - started
    assert events[-1] == "data: [DONE]"
    after = _samples(url)
    for name in HISTOGRAMS:
        assert _value(after, name + "_count") - _value(before, name + "_count") >= 1, name
        assert (name + "_bucket", (("le", "2560.0"), ("model_name", "pymoe"))) in after, name
    assert _value(after, "vllm:inter_token_latency_seconds_count") - \
        _value(before, "vllm:inter_token_latency_seconds_count") >= 1
    ttft = _value(after, "vllm:time_to_first_token_seconds_sum") - _value(before, "vllm:time_to_first_token_seconds_sum")
    e2e = _value(after, "vllm:e2e_request_latency_seconds_sum") - _value(before, "vllm:e2e_request_latency_seconds_sum")
    assert 0 < ttft <= e2e <= took
    assert _value(after, "vllm:request_success_total", finished_reason="length") - \
        _value(before, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(after, "vllm:generation_tokens_total") - _value(before, "vllm:generation_tokens_total") == 6
    assert _value(after, "vllm:request_generation_tokens_sum") - _value(before, "vllm:request_generation_tokens_sum") == 6
    assert ("moeswarm_time_to_first_token_seconds_count", (("prefix_cache", "miss"),)) in after  # the old names stay


def test_gauges_drop_when_a_client_goes_away(trained_serve):
    url = trained_serve.url
    before = _samples(url)
    body = {"model": "pymoe", "prompt": "def fib(n):\n", "max_tokens": 200, "temperature": 0, "stream": True,
            "logit_bias": {"0": -100}}  # no end of text (id 0): it runs until the client leaves
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # streaming: it runs now
        running = _samples(url)
        assert _value(running, "vllm:num_requests_running") == 1
        assert running[("moeswarm_active_sequences", ())] == 1
    gone = time.monotonic()
    while time.monotonic() < gone + 5:
        now = _samples(url)
        if _value(now, "vllm:num_requests_running") == 0 and now[("moeswarm_active_sequences", ())] == 0:
            break
        time.sleep(0.02)
    assert _value(now, "vllm:num_requests_running") == 0 and now[("moeswarm_active_sequences", ())] == 0
    assert time.monotonic() - gone < 1.0  # at once, not at a later step's end
    deadline = time.monotonic() + 10  # the abort is counted when the engine takes the request out
    while time.monotonic() < deadline:
        aborted = _value(_samples(url), "vllm:request_success_total", finished_reason="abort")
        if aborted - _value(before, "vllm:request_success_total", finished_reason="abort") == 1:
            break
        time.sleep(0.05)
    assert aborted - _value(before, "vllm:request_success_total", finished_reason="abort") == 1
