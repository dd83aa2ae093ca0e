"""Drafts from the backbone itself, with only its local experts (self-speculation, no round trip).

While drafting, every MoE layer's experts hook computes the routed experts the backbone holds
itself and drops the others: the routing weights of the kept experts are scaled so that they sum
to what all k of the token's weights summed to (`renormalise`); a token none of whose experts is
local gets no routed output (its shared expert and residual stay: they are the model's own code).
The draft tokens are that cheaper model's argmax, one forward each on the real KV cache, which is
cropped back afterwards: the verify forward then recomputes every position with all the experts,
so what the drafts were never changes the output, only how many tokens one verify step yields.

Legend: T = tokens, k = router top-k, d = hidden size.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from moeswarm.dispatch.combine import combine_exact
from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.model.experts import experts_modules
from moeswarm.wire.config import CombineMode
from moeswarm.wire.messages import Dispatch

LOCAL_BRANCHES = 2  # alternatives for the first draft token (docs/local-experts.md: measured 2 against 3)


class LocalDraftError(MoeSwarmError):
    """Local drafts asked for where the backbone holds no experts."""


def renormalise(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, weights) [T, k] each: the routing restricted to the `held` experts [H].

    A choice of an expert not held becomes -1 with weight 0; the kept weights are scaled by
    (sum of the token's k weights) / (sum of its kept weights), so they sum to what the k did.
    When every choice is held the weights come back unchanged, bit for bit (the scale is exactly 1).
    """
    local = torch.isin(top_k_index, held)  # [T, k]
    total = top_k_weights.sum(-1, keepdim=True)  # [T, 1]
    kept = torch.where(local, top_k_weights, torch.zeros_like(top_k_weights))  # [T, k]
    kept_sum = kept.sum(-1, keepdim=True)  # [T, 1]; 0 where nothing is held
    scale = torch.where(kept_sum > 0, total / kept_sum.clamp_min(torch.finfo(kept_sum.dtype).tiny), 0.0)  # [T, 1]
    index = torch.where(local, top_k_index, torch.full_like(top_k_index, -1))  # [T, k]
    return index, kept * scale


class LocalExperts:
    """The experts hook's dispatcher while drafting: `store`'s experts only, computed here.

    store: an ExpertStore (`held` {layer: experts}, `run(Dispatch) -> Result`). A layer the store
    holds nothing of gives zeros (the layer's routed part is dropped).
    """

    def __init__(self, store):
        self.store = store
        self.held = {layer: torch.tensor(experts, dtype=torch.long) for layer, experts in store.held.items() if experts}

    def dispatch(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, d], top_k_index [T, k] int64, top_k_weights [T, k] -> the routed experts' sum [T, d]."""
        held = self.held.get(layer)
        if held is None:
            return torch.zeros_like(hidden)
        index, weights = renormalise(top_k_index, top_k_weights, held)  # [T, k] each
        if not (index >= 0).any():
            return torch.zeros_like(hidden)
        result = self.store.run(Dispatch(layer, hidden, index, weights, CombineMode.EXACT))
        blocks = torch.split(result.outputs, result.counts)  # per expert: [n_e, d], eager's row order
        return combine_exact(hidden, index, dict(zip(result.experts, blocks)))  # [T, d]

    def combine(self, handle: torch.Tensor) -> torch.Tensor:
        return handle


@contextlib.contextmanager
def local_only(model: torch.nn.Module, store) -> Iterator[None]:
    """Within the block, `model`'s MoE layers run on `store`'s experts only (no network).

    Only the bindings' dispatcher changes: whatever else a binding carries (the shared expert's
    overlap) stays as it was.
    """
    modules = [module for _, module in experts_modules(model).values()]
    saved = [module._moeswarm for module in modules]
    experts = LocalExperts(store)
    try:
        for module, binding in zip(modules, saved):
            module._moeswarm = dataclasses.replace(binding, dispatcher=experts)
        yield
    finally:
        for module, binding in zip(modules, saved):
            module._moeswarm = binding


class LocalDrafter:
    """Greedy drafts from the local-experts model.

    `draft` (one draft: serve, sampled generation) adapts its length: it starts at the cap; after
    a step that accepted every draft it grows by one (up to the cap), after a rejection it becomes
    the accepted count (at least 1): the rule serve's n-gram drafts follow too.

    `branches` (greedy generation) drafts LOCAL_BRANCHES alternatives: the cheaper model's best
    few first tokens, each continued greedily, all in the same local forwards (one row each). The
    first token is where the cheaper model is least sure of itself; past it, a branch that starts
    right tends to stay right. Branches are always as long as the cap allows: a draft position
    costs one local forward of the backbone (a few ms) and pays when it saves a step (a round trip
    per MoE layer), so it is worth drafting even when rarely accepted. Measured in-process on the
    trained model, 25 % local, cap 6: 2.71 tokens per verify step against 2.30 with the adaptive
    length. On a LAN, where a step costs about as much as a few local forwards, lower the cap
    (--speculate).
    """

    name = "local"

    def __init__(self, model: torch.nn.Module, store):
        if store is None:
            raise LocalDraftError("local drafts need experts held by the backbone: pass --local-experts")
        self.model = model
        self.store = store
        self.length: int | None = None  # None: not set yet (the cap)

    def draft(self, context: list[int], stepper: Stepper, limit: int) -> list[int]:
        """Up to `limit` tokens to follow `context`; `stepper` holds context[:-1] and is left so."""
        count = limit if self.length is None else min(limit, self.length)
        found = self._drafts(context, stepper, count, 1)
        return found[0] if found else []

    def branches(self, context: list[int], stepper: Stepper, limit: int) -> list[list[int]]:
        """Up to LOCAL_BRANCHES drafts of `limit` tokens, with distinct first tokens."""
        return self._drafts(context, stepper, limit, LOCAL_BRANCHES if stepper.branchable else 1)

    def _drafts(self, context: list[int], stepper: Stepper, count: int, width: int) -> list[list[int]]:
        """`width` drafts of `count` tokens each (the best `width` first tokens, then greedy)."""
        if count <= 0:
            return []
        start = stepper.length
        rows: list[list[int]] = []
        try:
            with local_only(self.model, self.store):
                logits = stepper.forward([context[-1]])[-1]  # [V]
                rows = [[token] for token in logits.topk(width).indices.tolist()]
                for _ in range(count - 1):
                    logits = stepper.forward_rows([row[-1:] for row in rows])[:, -1]  # [B, V]
                    for row, token in zip(rows, logits.argmax(-1).tolist()):
                        row.append(token)
        finally:
            stepper.keep_row(0)
            stepper.crop(start)  # the drafts' cache entries came from the cheaper model: never kept
        return rows

    def feedback(self, drafted: int, accepted: int, limit: int) -> None:
        if drafted:
            self.length = next_draft_length(drafted, accepted, limit)


def next_draft_length(drafted: int, accepted: int, cap: int) -> int:
    """The next step's draft length: one more after full acceptance (up to `cap`), else the accepted count (>= 1)."""
    return min(cap, drafted + 1) if accepted == drafted else max(1, accepted)
