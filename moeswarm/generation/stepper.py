"""A model plus its KV cache: feed tokens, get logits, roll back rejected drafts."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


class Stepper:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        # The model makes its own cache on the first forward: some families (MiniMax) only
        # accept their own cache class.
        self.cache = None

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the cached context; return their logits [n, V] in float32."""
        ids = torch.tensor([tokens], dtype=torch.long)  # [1, n]
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0].float()

    def crop(self, length: int) -> None:
        """Forget cached positions from `length` on (rejected draft tokens)."""
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)  # transformers 5 takes the number of tokens to remove, negated
