"""A model plus its KV cache: feed tokens, get logits, roll back rejected drafts.

Branches: `forward_rows` feeds several equally long token rows after the cached context at once,
as B alternative continuations of it (the cache is copied B times along the batch), and
`keep_row` keeps one of them. One forward, so one round trip per MoE layer, verifies them all.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from moeswarm.kernels.quant_linear import QuantLinear


class Stepper:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        # The model makes its own cache on the first forward: some families (MiniMax) only
        # accept their own cache class.
        self.cache = None
        self.rows = 1  # the cache's batch: B after forward_rows of B rows, until keep_row
        self._head_rows_independent: bool | None = None

    @property
    def length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @property
    def branchable(self) -> bool:
        """Whether the cache can be copied along the batch and cut back to one row: plain attention
        caches only (a sliding-window or recurrent layer's state cannot be cropped per branch)."""
        return type(self.cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in self.cache.layers)

    @torch.inference_mode()
    def forward(self, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """Feed `tokens` after the cached context; return their logits [n, V] in float32 (one branch).

        last_only: only the last token's logits [1, V] (a prompt's: the others are not sampled from),
        where that gives the same bits as the full forward's last row (`head_rows_independent`);
        elsewhere all n rows, as without it."""
        if self.rows != 1:
            raise ValueError(f"the cache holds {self.rows} branches: keep one first")
        keep = {"logits_to_keep": 1} if last_only and len(tokens) > 1 and self.head_rows_independent else {}
        return self._forward(torch.tensor([tokens], dtype=torch.long), **keep)[0]  # ids [1, n]

    @property
    def head_rows_independent(self) -> bool:
        """Whether each row of the output head's product has the bits it has in any batch of rows
        (a GGUF head kept in its blocks: qkernels' rows depend on their own input only), and the
        model takes `logits_to_keep`. A float head goes through torch's matmul, whose bits may
        depend on the number of rows."""
        if self._head_rows_independent is None:
            head = self.model.get_output_embeddings()
            takes = "logits_to_keep" in inspect.signature(self.model.forward).parameters
            self._head_rows_independent = isinstance(head, QuantLinear) and takes
        return self._head_rows_independent

    @torch.inference_mode()
    def forward_rows(self, rows: list[list[int]]) -> torch.Tensor:
        """Feed B rows of n tokens each after the cached context, as B branches: logits [B, n, V].

        The first call with B > 1 copies the cache B times; later calls with B rows continue each
        branch on its own copy, until `keep_row`."""
        if len(rows) != self.rows:
            if self.rows != 1 or not self.branchable:
                raise ValueError(f"cannot feed {len(rows)} branches to a cache of {self.rows} "
                                 f"({type(self.cache).__name__})")
            self.cache.batch_repeat_interleave(len(rows))
            self.rows = len(rows)
        return self._forward(torch.tensor(rows, dtype=torch.long))  # ids [B, n]

    def keep_row(self, row: int) -> None:
        """Keep branch `row`'s cache only (after forward_rows; with one row, nothing to do)."""
        if self.rows > 1:
            self.cache.batch_select_indices(torch.tensor([row]))
            self.rows = 1

    def _forward(self, ids: torch.Tensor, **options) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, **options)
        self.cache = out.past_key_values
        return out.logits.float()  # [B, n, V]

    def crop(self, length: int) -> None:
        """Forget cached positions from `length` on (rejected draft tokens)."""
        surplus = self.length - length
        if surplus > 0:
            self.cache.crop(-surplus)  # transformers 5 takes the number of tokens to remove, negated
