"""How a request becomes a running sequence: its caches and its drafter.

A request's KV cache starts from a sibling's (an active sequence with its very prompt: n > 1, or
the same prompt sent twice, which waits a step while the sibling prefills), else from the prefix
cache (finished sequences' caches), else empty. A request asking for log-probabilities takes
neither: its values are those of a plain forward of the whole prompt.
"""

from __future__ import annotations

from moeswarm.generation.draft_suffix import SuffixHistory
from moeswarm.generation.drafters import make_drafter
from moeswarm.engine.job import Job
from moeswarm.engine.prefix_cache import PrefixCache
from moeswarm.engine.sequence import Sequence


class Admission:
    def __init__(self, swarm, codec, config, runner, reference_runner, metrics, packed: bool, drafter=None):
        self.swarm, self.codec, self.config, self.metrics = swarm, codec, config, metrics
        self.drafter = drafter  # makes a sequence's drafter (None: config.draft's)
        self.runner, self.reference_runner = runner, reference_runner
        self.packed = packed  # caches can be copied (forward/sequence_cache.py)
        self.prefix_cache = PrefixCache(config.cache_slots, config.prefill_chunk)
        self.suffix_history = SuffixHistory()  # --draft suffix looks in the recent requests too

    def waits(self, job: Job, active: list[Sequence]) -> bool:
        """Whether `job` should wait a step: a sibling is prefilling its prompt."""
        return self._sibling(job, active, prefilling=True) is not None

    def start(self, job: Job, active: list[Sequence]) -> Sequence:
        config = self.config
        speculate = config.speculate if job.speculate is None else min(job.speculate, config.speculate)
        reused, caches = (0, None) if job.plain_forwards else self._shared_prompt(job, active) or self.prefix_cache.take(job.prompt)
        stepper = self.runner.stepper()
        reference = self.reference_runner.stepper() if self.reference_runner is not None else None
        if caches is not None:
            for taker, cache in zip((stepper, reference), caches):
                if taker is not None:
                    taker.cache = cache
                    taker.crop(reused)
        (self.metrics.prefix_hits if reused else self.metrics.prefix_misses).inc()
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self.metrics.cached_prompt_tokens.inc(reused)
        drafter = None
        if speculate:
            drafter = self.drafter() if self.drafter is not None else \
                make_drafter(config.draft, self.swarm.model, self.swarm.local_store, self.suffix_history)
        return Sequence(job, stepper, self.codec, speculate, reused, reference, drafter)

    def _sibling(self, job: Job, active: list[Sequence], prefilling: bool) -> Sequence | None:
        """An active sequence with `job`'s very prompt: one still prefilling it (prefilling=True), or
        one whose cache holds it all."""
        if not self.packed or job.plain_forwards:
            return None
        for sequence in active:
            if sequence.job.prompt == job.prompt and not sequence.scored and prefilling == bool(sequence.prefill_left):
                return sequence
        return None

    def _shared_prompt(self, job: Job, active: list[Sequence]) -> tuple[int, tuple] | None:
        """(reused length, caches) copied from a sibling that has the whole prompt cached: every
        position but the last prompt token's, which is fed again for the first token's logits."""
        sibling = self._sibling(job, active, prefilling=False)
        if sibling is None or len(job.prompt) < 2:
            return None
        reused = len(job.prompt) - 1
        reference = sibling.reference.cache.copy(reused) if sibling.reference is not None else None
        return reused, (sibling.stepper.cache.copy(reused), reference)

