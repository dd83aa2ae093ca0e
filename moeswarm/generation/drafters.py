"""Where a speculative step's drafts come from: `--draft ngram|local|both`.

ngram  prompt lookup (draft.py): free, good on text that repeats itself, silent elsewhere.
local  the backbone with only its local experts (draft_local.py): a few local forwards per step,
       a draft on any text; needs experts held by the backbone (--local-experts).
suffix the longest earlier match of the context's end in this request and the recent ones
       (draft_suffix.py): free, and its drafts grow with the match (files re-emitted, repeated
       scaffolding).
both   greedy (generate and serve): the n-gram and the local drafts side by side (branches,
       below). Sampled: the n-gram draft when the context's last two or more tokens occurred
       before (a lookup that strong is usually right, and free), else the local draft. A lone repeated
       token is too weak a match: on prose nearly every token has occurred before.

Every drafter answers `draft(context, stepper, limit)` (one draft, with `stepper`'s cache left
as it was) and `branches(context, stepper, limit)` (several alternative drafts, the first being
its best guess), and takes `feedback(drafted, accepted, cap)` after the verify step. Greedy
generation verifies all the branches in one forward (generation/branches.py): the same round
trips as one draft, a longer accepted run. The model-free drafters also answer
`support(context, drafts)`: each draft's acceptance estimate per position, from the text's evidence
for it (generation/draft_support.py), by which the goodput rule sizes a step's drafts before they
are fed (engine/speculation.py); a drafter without it is sized by its measured acceptance alone.
The verify rule makes the output independent of the
drafts, so a drafter changes the speed, never the tokens.
"""

from __future__ import annotations

from typing import Protocol

import torch

from moeswarm.generation.draft import propose, propose_many
from moeswarm.generation.draft_local import LocalDrafter
from moeswarm.generation.draft_names import DRAFTERS
from moeswarm.generation.draft_suffix import Document, SuffixDrafter, SuffixHistory, matches
from moeswarm.generation.draft_support import support
from moeswarm.forward.stepper import Stepper

STRONG_NGRAM = 2  # the shortest n-gram match `both` takes over the local draft (one draft)
NGRAM_BRANCHES = 3  # continuations of distinct earlier occurrences verified side by side


class Drafter(Protocol):
    name: str

    def draft(self, context: list[int], stepper: Stepper, limit: int) -> list[int]:
        """Up to `limit` tokens to follow `context`; `stepper` holds context[:-1], and is left so."""

    def branches(self, context: list[int], stepper: Stepper, limit: int) -> list[list[int]]:
        """Alternative drafts of up to `limit` tokens each (distinct, the best guess first); [] for none."""

    def feedback(self, drafted: int, accepted: int, cap: int) -> None:
        """How the last draft fared: `accepted` of `drafted` kept; `cap` is the most a draft may hold."""


class NgramDrafter:
    name = "ngram"

    def __init__(self, min_ngram: int = 1):
        self.min_ngram = min_ngram

    def draft(self, context: list[int], stepper: Stepper, limit: int) -> list[int]:
        return propose(context, limit, min_ngram=self.min_ngram)

    def branches(self, context: list[int], stepper: Stepper, limit: int) -> list[list[int]]:
        return propose_many(context, limit, NGRAM_BRANCHES, min_ngram=self.min_ngram)

    def support(self, context: list[int], drafts: list[list[int]], greedy: bool = True) -> list[list[float]]:
        """Each draft's acceptance estimate per position, from the earlier occurrences of the context's end."""
        occurrences = matches(context, [Document(context)], max(map(len, drafts), default=0))
        return [support(occurrences, draft, greedy) for draft in drafts]

    def feedback(self, drafted: int, accepted: int, cap: int) -> None:
        pass  # a lookup costs nothing: always propose up to the cap


class BothDrafter:
    """Branches: every n-gram continuation and the local drafts. One draft: the n-gram draft on a
    match of STRONG_NGRAM tokens or more, else the local one."""

    name = "both"

    def __init__(self, local: LocalDrafter):
        self.ngram = NgramDrafter(STRONG_NGRAM)
        self.any_ngram = NgramDrafter()
        self.local = local
        self.last: Drafter | None = None  # which one drafted the last step

    def draft(self, context: list[int], stepper: Stepper, limit: int) -> list[int]:
        tokens = self.ngram.draft(context, stepper, limit)
        self.last = self.ngram if tokens else self.local
        return tokens or self.local.draft(context, stepper, limit)

    def branches(self, context: list[int], stepper: Stepper, limit: int) -> list[list[int]]:
        self.last = self.local  # the local drafter's length adapts to the best branch's acceptance
        found = self.any_ngram.branches(context, stepper, limit)
        return found + [draft for draft in self.local.branches(context, stepper, limit) if draft not in found]

    def feedback(self, drafted: int, accepted: int, cap: int) -> None:
        if self.last is not None:
            self.last.feedback(drafted, accepted, cap)


def make_drafter(kind: str, model: torch.nn.Module, store, history: SuffixHistory | None = None) -> Drafter:
    """The drafter `kind` names (DRAFTERS); store: the backbone's local ExpertStore, or None;
    history: the recent requests a suffix drafter also looks in (None: its own request only)."""
    if kind == "ngram":
        return NgramDrafter()
    if kind == "suffix":
        return SuffixDrafter(history)
    if kind == "local":
        return LocalDrafter(model, store)
    if kind == "both":
        return BothDrafter(LocalDrafter(model, store))
    raise ValueError(f"unknown drafter {kind!r} (known: {', '.join(DRAFTERS)})")
