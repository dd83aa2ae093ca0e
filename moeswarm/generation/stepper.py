"""A model plus its KV cache: feed tokens, get logits, roll back rejected drafts."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class Stepper:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.inference_mode()
    def forward(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` after the cached context; return their logits [n, V] in float32."""
        ids = torch.tensor([tokens], dtype=torch.long)  # [1, n]
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        return out.logits[0].float()

    def crop(self, length: int) -> None:
        """Forget cached positions from `length` on (rejected draft tokens)."""
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)  # transformers 5 takes the number of tokens to remove, negated
