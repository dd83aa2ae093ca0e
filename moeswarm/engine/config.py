"""The engine's configuration: one frozen record of what serve and generate set (engine/engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

from moeswarm.generation.draft_names import DEFAULT_DRAFT


@dataclass(frozen=True)
class EngineConfig:
    context: int  # positions a sequence may use (prompt + output)
    max_batch: int = 16  # sequences stepped together; more wait in the queue
    speculate: int | None = 0  # most drafts per sequence per step, in each of its branches (0: off; None: on with
    # AUTO_SPECULATE and the goodput rule where steps have remote trips, off otherwise: engine/speculation.py)
    prefill_chunk: int = 64  # most prompt tokens a sequence feeds per step
    step_tokens: int = 256  # token budget of a step (decode tokens first, then prompt chunks); more, up to GROWTH
    # times, while their compute fits in the step's wait on replies (engine/step_budget.py)
    cache_slots: int = 8  # finished sequences' KV caches kept for prefix reuse (0: off)
    keep_accounting: bool = False  # keep every layer call in the swarm's accounting (one generation); else per step
    health_interval_s: float = 2.0
    draft: str = DEFAULT_DRAFT  # where drafts come from (generation/drafters.py): ngram, suffix, local or both
    groups: int = 0  # batches in flight per step (engine/turns.py); 0: one or two, by measurement (engine/group_policy.py)
    adaptive: bool = False  # each step's drafts chosen by the goodput rule, `speculate` their cap (engine/speculation.py)
