"""A prompt's tokens, checked against the model before anything is generated.

Each check raises MoeSwarmError naming the numbers involved, so a command can run them before it
loads a backbone or connects to a worker (they need only the config and the tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PretrainedConfig

from moeswarm.errors import MoeSwarmError
from moeswarm.sources.tokenizer import TextCodec


def prompt_tokens(codec: TextCodec, text: str | None, ids: Sequence[int] | None) -> list[int]:
    """The prompt as token ids: `ids` when given, else `text` encoded; checked against the vocabulary."""
    if ids is None:
        if not text:
            raise MoeSwarmError("the prompt is empty: give some text with --prompt or --prompt-file, or token ids with --prompt-ids")
        ids = codec.encode(text)
    check_prompt_ids(ids, codec.vocab_size)
    return list(ids)


def check_prompt_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise unless there is at least one id and every id is in [0, vocab_size)."""
    if not ids:
        raise MoeSwarmError("the prompt gives no tokens: give some text with --prompt or --prompt-file, or token ids with --prompt-ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise MoeSwarmError(f"token id {bad} is out of range: the model's vocabulary has {vocab_size} ids "
                            f"(0 to {vocab_size - 1})")


def check_context(config: PretrainedConfig, prompt_tokens: int, max_new_tokens: int) -> None:
    """Raise when the prompt and the new tokens need more positions than the model has.

    The model's positions are `max_position_embeddings` (not checked when the config has none).
    Past them a rotary model still runs, silently, on positions it was never trained on.
    """
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and prompt_tokens + max_new_tokens > positions:
        raise MoeSwarmError(f"the prompt ({prompt_tokens} token{'s' * (prompt_tokens != 1)}) plus --max-new-tokens ({max_new_tokens}) is "
                            f"{prompt_tokens + max_new_tokens} tokens, more than the model's {positions} positions "
                            f"(max_position_embeddings): shorten the prompt or lower --max-new-tokens")
