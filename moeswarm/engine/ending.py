"""When an output may end: vLLM's ignore_eos and min_tokens.

ignore_eos: the end-of-text token is a token like any other (kept in the output's tokens, not shown
in its text), so only max_tokens, a stop string or a finished grammar ends the output.
min_tokens: until the output has that many tokens, the end-of-text token cannot be chosen (its
logit is -inf at those positions; log-probabilities stay the model's own) and stop strings are not
looked for; afterwards a stop string counts when it ends after the text of the first
min_tokens - 1 tokens, as vLLM's stop check looks at the new text only once min_tokens is reached.
"""

from __future__ import annotations

import torch


def hold_eos(rows: torch.Tensor, eos: int | None, produced: int, min_tokens: int) -> torch.Tensor:
    """rows [..., P, V]: the scores of positions produced, produced + 1, ... of the output; the
    end-of-text token masked at those still short of min_tokens (a copy; `rows` when none is)."""
    short = min(rows.shape[-2], min_tokens - produced)
    if eos is None or short <= 0:
        return rows
    rows = rows.clone()
    rows[..., :short, eos] = -torch.inf
    return rows


def find_stop_after(text: str, stops: tuple[str, ...], floor: int) -> int | None:
    """Where the earliest stop string in `text` that ends after character `floor` starts, or None."""
    found = [index for index in (text.find(stop, max(0, floor - len(stop) + 1)) for stop in stops if stop)
             if index >= 0]
    return min(found) if found else None
