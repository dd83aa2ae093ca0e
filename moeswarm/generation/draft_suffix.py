"""Drafts that need no model: the longest earlier match of the context's end (`--draft suffix`).

SuffixDecoding's idea, without a suffix tree: the text to search is the request's own prompt and
output, plus the recent requests' (a bounded `SuffixHistory` shared by the drafters of one
process: agents re-emit files, re-ask questions, repeat tool-call scaffolding). Every document keeps
an index {token: positions}, extended as the document grows. To draft, each earlier occurrence of
the context's last token is extended backwards while it keeps matching the context; the longest
matches win. What followed them is the draft, as long as the match earns: `SPEC_PER_MATCH` draft
tokens per matched token (a one-token match is a weak guess, a 40-token match a strong one), up to
the step's limit. Distinct continuations of the best matches are the branches a greedy step
verifies side by side. A sampled request's one draft comes from its own text only: its random
draws follow its drafts, and the same seed must give the same tokens whatever else ran.

`support` scores the drafts it just gave, position by position, from the same occurrences
(draft_support.py): what the goodput rule sizes a step's drafts by.

The verify rule makes the output independent of the drafts: a drafter changes the speed, never the
tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeswarm.generation.draft_support import support

MAX_MATCH = 64  # the longest match measured (longer ones draft as much as that)
CANDIDATES = 256  # latest occurrences of the last token examined per document
SPEC_PER_MATCH = 2.0  # draft tokens per matched token
BRANCHES = 3  # continuations verified side by side
HISTORY = 32  # recent requests' documents kept


@dataclass(eq=False)
class Document:
    """A token list that only grows (a request's context), with the positions of each token."""

    tokens: list[int]
    positions: dict[int, list[int]] = field(default_factory=dict)
    indexed: int = 0

    def refresh(self) -> None:
        for i in range(self.indexed, len(self.tokens)):
            self.positions.setdefault(self.tokens[i], []).append(i)
        self.indexed = len(self.tokens)


class SuffixHistory:
    """The documents drafts are looked up in: the most recent `size` requests' contexts."""

    def __init__(self, size: int = HISTORY):
        self.documents: deque[Document] = deque(maxlen=size)

    def add(self, tokens: list[int]) -> Document:
        document = Document(tokens)
        self.documents.append(document)
        return document


@dataclass(frozen=True)
class Match:
    length: int  # tokens of the context's end matched
    continuation: list[int]


def matches(context: list[int], documents: list[Document], limit: int) -> list[Match]:
    """Earlier occurrences of the context's end, the longest first (then the latest), each with up to
    `limit` tokens that followed it."""
    if not context or limit <= 0:
        return []
    last, found = context[-1], []
    for document in documents:
        document.refresh()
        tokens = document.tokens
        for position in reversed(document.positions.get(last, [])[-CANDIDATES:]):
            if position + 1 >= len(tokens):  # nothing followed it (in `own`: the context's end itself)
                continue
            length = 1
            while (length < MAX_MATCH and length <= position and length < len(context)
                   and tokens[position - length] == context[-1 - length]):
                length += 1
            found.append(Match(length, tokens[position + 1 : position + 1 + limit]))
    found.sort(key=lambda m: -m.length)  # stable: the latest first within one length
    return found


class SuffixDrafter:
    name = "suffix"

    def __init__(self, history: SuffixHistory | None = None):
        self.history = history if history is not None else SuffixHistory()
        self.own: Document | None = None
        self.found: tuple[int, list[Match]] = (-1, [])  # (context length, occurrences) of the latest drafts

    def _own(self, context: list[int]) -> Document:
        own = self.own
        if own is None or (own.tokens is not context and own.tokens != context[: len(own.tokens)]):
            self.own = self.history.add(context)
        elif own.tokens is not context:  # a caller passing a new, longer list each step
            own.tokens = context
        return self.own

    def branches(self, context: list[int], stepper, limit: int) -> list[list[int]]:
        """Greedy steps: this request's text and the recent requests' (the output is the greedy one
        whatever the drafts)."""
        own = self._own(context)
        return self._drafts(context, [own] + [d for d in reversed(self.history.documents) if d is not own], limit, BRANCHES)

    def draft(self, context: list[int], stepper, limit: int) -> list[int]:
        """Sampled steps: this request's text only. A sampled step's random draws follow its drafts, so
        drafts from other requests would make the same seed give other tokens when others ran."""
        found = self._drafts(context, [self._own(context)], limit, 1)
        return found[0] if found else []

    def _drafts(self, context: list[int], documents: list[Document], limit: int, most: int) -> list[list[int]]:
        found: list[list[int]] = []
        occurrences = matches(context, documents, limit)
        self.found = (len(context), occurrences)
        for match in occurrences:
            draft = match.continuation[: max(1, min(limit, int(SPEC_PER_MATCH * match.length)))]
            if draft and draft not in found:
                found.append(draft)
                if len(found) == most:
                    break
        return found

    def support(self, context: list[int], drafts: list[list[int]], greedy: bool = True) -> list[list[float]]:
        """Each of the drafts just given for `context`: its acceptance estimate per position, from the
        occurrences they were drafted from (this request's text only when none were found for it)."""
        at, occurrences = self.found
        if at != len(context):
            occurrences = matches(context, [self._own(context)], max(map(len, drafts), default=0))
        return [support(occurrences, draft, greedy) for draft in drafts]

    def feedback(self, drafted: int, accepted: int, cap: int) -> None:
        pass  # the length follows each match's own length
