"""How strongly the text supports a model-free draft: an acceptance estimate per draft position.

SuffixDecoding scores a draft by the counts in its suffix tree; this is that score without the tree.
A lookup drafter's evidence is the earlier occurrences of the context's end (draft_suffix.py's
`matches`: each an occurrence's match length and the tokens that followed it). Only the strongest
tier counts: the occurrences matched at least half as long as the longest (a 40-token match is not
outvoted by a hundred one-token ones). For a draft d, position i (0-based) is judged by the tier's
occurrences that agree with d[:i], those the text would still be following once d[:i] is kept:

    f_i = (those followed by d[i] at i) / (those that reach i)     the continuation's frequency
    m_i = the longest match among those followed by d[i]            (else among those that reach i)
    e_i = f_i * (m_i + i) / (m_i + i + h)                           an estimate of P(d[i] kept | d[:i] kept)

The second factor is the match's own weight: once d[:i] is kept the text has matched m + i tokens,
and a longer match is likelier to go on. h, the matched length at which that weight is one half, is
larger for a sampled step than a greedy one: a sampled draft token is kept only when the model
draws it, a greedy one whenever it is the model's likeliest (and a greedy model, given a context it
has seen, tends to continue as it did: docs/drafts.md has the calibration measured). A file being re-emitted (one long match) gives e near 1 at
every position; a one-token match among many continuations (prose, sampled text) gives e near 0.
Positions no occurrence reaches get 0. The engine calibrates these against what verify steps keep
(draft_measure.py's Calibration) before the goodput rule reads them.

Plain numbers in, numbers out: no clocks, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

HALF_TRUST = {True: 1.0, False: 2.0}  # h, greedy and sampled: the matched length at which the match's own weight is one half
MOST_OCCURRENCES = 64  # occurrences of the strongest tier judged (the first ones: the longest, the latest)


class Occurrence(Protocol):
    length: int  # tokens of the context's end matched there
    continuation: list[int]  # what followed it


def support(found: Sequence[Occurrence], draft: Sequence[int], greedy: bool = True) -> list[float]:
    """e_1..e_len(draft) for `draft` given the occurrences `found` (any order); all 0 without any.
    greedy: whether the step keeps the model's likeliest token (else it samples)."""
    if not found or not draft:
        return [0.0] * len(draft)
    top = max(o.length for o in found)
    following = [o for o in found if 2 * o.length >= top][:MOST_OCCURRENCES]
    estimates: list[float] = []
    for i, token in enumerate(draft):
        reaching = [o for o in following if len(o.continuation) > i]
        if not reaching:
            break
        agreeing = [o for o in reaching if o.continuation[i] == token]
        longest = max(o.length for o in (agreeing or reaching)) + i
        estimates.append(len(agreeing) / len(reaching) * longest / (longest + HALF_TRUST[greedy]))
        following = agreeing
    return estimates + [0.0] * (len(draft) - len(estimates))
