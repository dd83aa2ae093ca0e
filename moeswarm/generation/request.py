"""A generation as `generate` and `demo` ask for it (generation/run.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from moeswarm.generation.draft_names import DEFAULT_DRAFT
from moeswarm.generation.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 32
    speculate: int = 0
    check_local: bool = False
    sampling: SamplingParams = SamplingParams()
    stops: tuple[str, ...] = ()
    draft: str = DEFAULT_DRAFT  # where the drafts come from: generation/drafters.py's DRAFTERS
