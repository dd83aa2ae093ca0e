"""What one generation produced: its tokens, how it ended, its steps and drafts, its local check."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeswarm.generation.check import LocalCheck


@dataclass(frozen=True)
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)  # the output, its end-of-sequence token included
    steps: int = 0  # forwards after the prompt's
    drafted: int = 0  # draft tokens of the branches kept (one a step)
    accepted: int = 0
    branches: int = 0  # drafts verified side by side, summed over the steps (generation/branches.py)
    drafted_all: int = 0  # draft tokens verified, over every branch
    seconds: float = 0.0  # in the backbone's forwards and the drafting (the check against local is not counted)
    draft_seconds: float = 0.0  # drafting (local drafts: the local-experts forwards)
    prefill_seconds: float = 0.0
    finish_reason: str | None = None  # "stop": eos or a stop string; "length": max_new_tokens reached
    check: LocalCheck | None = None  # with a reference
    text: str = ""  # the output's text as shown (a stop string and what follows it cut off)
    speculate: int = 0  # the cap of drafts per step it ran with (the default resolved)
    speculation: dict = field(default_factory=dict)  # engine/speculation.py's SequenceDrafts.summary(): K chosen, acceptance

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def bit_identical(self) -> bool | None:
        return None if self.check is None else self.check.bit_identical

    @property
    def tokens_match(self) -> bool | None:
        return None if self.check is None else self.check.tokens_match

    @property
    def first_mismatch(self) -> str | None:
        return None if self.check is None else self.check.first_mismatch

    @property
    def max_abs_diff(self) -> float:
        return 0.0 if self.check is None else self.check.max_abs_diff
