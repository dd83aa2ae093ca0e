"""The gateway's Prometheus metrics (GET /metrics), in a registry of its own: moeswarm's own series
(`moeswarm_*`) and vLLM's names for the same meanings (`vllm:*`: engine/request_metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from moeswarm.dispatch.accounting import LayerCall
from moeswarm.engine.request_metrics import VllmMetrics

_SMALL_COUNTS = (1, 2, 4, 8, 16, 32, 64)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_BYTES = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8)
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServeMetrics:
    def __init__(self, model_name: str = ""):
        disable_created_metrics()  # no *_created series: a scrape shows what a reader needs
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("moeswarm_requests", "HTTP requests answered, by route and status", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("moeswarm_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.cached_prompt_tokens = Counter("moeswarm_cached_prompt_tokens", "prompt tokens taken from the prefix cache", registry=r)
        self.generated_tokens = Counter("moeswarm_generated_tokens", "tokens generated", registry=r)
        self.drafted = Counter("moeswarm_drafted_tokens", "draft tokens fed for verification", registry=r)
        self.accepted = Counter("moeswarm_accepted_drafts", "draft tokens accepted", registry=r)
        self.steps = Counter("moeswarm_steps", "engine steps (one batched forward each)", registry=r)
        self.batch_size = Histogram("moeswarm_step_batch_size", "sequences per step", buckets=_SMALL_COUNTS, registry=r)
        self.step_tokens = Histogram("moeswarm_step_tokens", "tokens fed per step", buckets=_TOKENS, registry=r)
        self.step_groups = Histogram("moeswarm_step_groups", "batches in flight per step (engine/turns.py)",
                                     buckets=_SMALL_COUNTS, registry=r)
        self.step_backbone_seconds = Histogram("moeswarm_step_backbone_seconds",
                                               "seconds of a step the backbone computed (not waiting on replies)", registry=r)
        self.step_round_trips = Histogram("moeswarm_step_round_trips", "round trips per step", buckets=_SMALL_COUNTS, registry=r)
        self.step_bytes = Histogram("moeswarm_step_bytes", "bytes on the wire per step, both ways", buckets=_BYTES, registry=r)
        self.step_seconds = Histogram("moeswarm_step_seconds", "wall time per step", buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("moeswarm_queue_depth", "requests waiting for a slot", registry=r)
        self.active = Gauge("moeswarm_active_sequences", "sequences in the batch", registry=r)
        self.kv_cache_bytes = Gauge("moeswarm_kv_cache_bytes", "bytes of keys and values the backbone holds (--kv-cache), "
                                    "by holder: the batch's sequences or the prefix cache", ["held_by"], registry=r)
        self.worker_rtt = Histogram("moeswarm_worker_rtt_seconds", "per-worker round-trip time of a layer call",
                                    ["worker"], buckets=_SECONDS, registry=r)
        self.first_token = Histogram("moeswarm_time_to_first_token_seconds", "from the request's arrival to its first token",
                                     ["prefix_cache"], buckets=_SECONDS, registry=r)
        self.prefix_hits = Counter("moeswarm_prefix_cache_hits", "requests that reused a cached prefix", registry=r)
        self.prefix_misses = Counter("moeswarm_prefix_cache_misses", "requests that prefilled their whole prompt", registry=r)
        self.checked_logits = Counter("moeswarm_check_local_logits", "logit rows compared with the local eager run", registry=r)
        self.mismatched_logits = Counter("moeswarm_check_local_mismatched_logits",
                                         "logit rows not bit-identical to the local eager run (--check-local)", registry=r)
        self.failed_sequences = Counter("moeswarm_failed_sequences", "sequences ended by an error", registry=r)
        self.rolled_back = Counter("moeswarm_rolled_back_sequences",
                                   "sequences sent back before steps that used a banned liar's answers", registry=r)
        self.vllm = VllmMetrics(r, model_name)

    def follow(self, running, waiting) -> None:
        """Read the request gauges from `running()` and `waiting()` (request counts, callable from any
        thread) at every scrape: a request that ends, or whose client goes away, leaves them at once."""
        self.active.set_function(running)
        self.queue_depth.set_function(waiting)
        self.vllm.running.labels(self.vllm.model_name).set_function(running)
        self.vllm.waiting.labels(self.vllm.model_name).set_function(waiting)

    def observe_step(self, batch: int, tokens: int, seconds: float, calls: list[LayerCall], groups: int = 1,
                     waiting_s: float = 0.0) -> None:
        self.steps.inc()
        self.step_groups.observe(groups)
        self.step_backbone_seconds.observe(max(0.0, seconds - waiting_s))
        self.batch_size.observe(batch)
        self.step_tokens.observe(tokens)
        self.step_seconds.observe(seconds)
        self.step_round_trips.observe(sum(c.round_trips for c in calls))
        self.step_bytes.observe(sum(c.bytes_out + c.bytes_in for c in calls))
        for call in calls:
            for worker, rtt in call.worker_seconds.items():
                self.worker_rtt.labels(worker).observe(rtt)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class UnrecordedMetrics:
    """ServeMetrics' interface keeping nothing: what a lone `generate` steps with (nobody scrapes it, and
    a step's dozen metric updates, one per layer call and worker among them, would be its only readers' cost)."""

    def __getattr__(self, name: str) -> "_Unrecorded":
        return _UNRECORDED

    def observe_step(self, *args, **kwargs) -> None:
        pass

    def follow(self, running, waiting) -> None:
        pass


class _Unrecorded:
    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def labels(self, *values: str) -> "_Unrecorded":
        return self

    def admitted(self, *args) -> None:  # the vllm series' (engine/request_metrics.py)
        pass

    def tokens(self, *args) -> None:
        pass

    def ended(self, *args) -> None:
        pass


_UNRECORDED = _Unrecorded()
