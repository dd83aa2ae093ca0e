"""A generation as `generate` and `demo` ask for it (engine/generate.py runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from moeswarm.generation.draft_names import DEFAULT_DRAFT
from moeswarm.generation.sampling import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 32
    speculate: int | None = 0  # most drafts per step (0: off; None: the default, on where steps have remote trips)
    check_local: bool = False
    sampling: SamplingParams = SamplingParams()
    stops: tuple[str, ...] = ()
    draft: str = DEFAULT_DRAFT  # where the drafts come from: generation/drafters.py's DRAFTERS
    speculate_policy: str = "fixed"  # "goodput": each step's drafts by the goodput rule under the cap (the commands'
    # default); "fixed": up to the cap every step (engine/speculation.py)
