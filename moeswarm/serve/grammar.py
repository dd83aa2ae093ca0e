"""Constrained decoding: a grammar (a JSON schema) masks the logits before any token is chosen.

llguidance (the `structured` extra) compiles the grammar against the model's tokenizer and says,
for each position, which tokens may come next (a bitmask over the vocabulary). Picked by
measurement on the bundled model's 4,096-token vocabulary (scripts/grammar_mask_cost.py): mask p50
7 us (llguidance), 3 us (xgrammar), 5 us (outlines-core), each well under 1 % of a step;
llguidance needs no other package (xgrammar pulls in triton), and compiles a schema in ~50 ms.

A draft is checked against the grammar before it is fed (cut at its first token the grammar
refuses), and each drafted position's logits are masked with the grammar's state after the drafts
before it, so speculative verification never accepts a token the grammar would not allow.

V = vocabulary size, L = drafts.
"""

from __future__ import annotations

import json

import torch

from moeswarm.errors import MoeSwarmError, one_line


class GrammarUnavailable(MoeSwarmError):
    pass


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise GrammarUnavailable("structured output needs llguidance: pip install 'moeswarm[structured]'") from None
    return llguidance


class Grammars:
    """The model's tokenizer as llguidance sees it (built once) and the constraints made from it."""

    def __init__(self, tokenizer, vocab_size: int):
        llg = _llguidance()
        self.vocab_size = vocab_size
        try:
            self.tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        except Exception as error:  # a tokenizer llguidance cannot read (not a fast HF one, say)
            raise GrammarUnavailable(f"structured output cannot use this model's tokenizer: {one_line(error)}") from None

    def json_schema(self, schema: dict) -> str:
        """The grammar of a JSON value matching `schema`, compactly spaced (a small model offered free
        whitespace may spend every token on it); ValueError
        naming the problem when llguidance cannot take the schema."""
        llg = _llguidance()
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
            problem = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)  # "" when it compiles
        except Exception as error:  # llguidance's own refusal of a schema, whatever its type
            raise ValueError(one_line(error)) from None
        if problem:
            raise ValueError(" ".join(str(problem).split()))
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(_llguidance().LLMatcher(self.tokenizer, grammar), self.vocab_size)


class Constraint:
    """One sequence's grammar state: masks, accepts, rolls back."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        llg = _llguidance()
        self._bits = llg.torch.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._shifts = torch.arange(32, dtype=torch.int32)

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens the grammar allows next."""
        _llguidance().torch.fill_next_token_bitmask(self.matcher, self._bits, 0)
        bits = (self._bits[0].unsqueeze(-1) >> self._shifts) & 1  # [ceil(V / 32), 32]
        return bits.flatten()[: self.vocab_size].bool()

    def mask(self, logits: torch.Tensor, drafts: list[int] = ()) -> torch.Tensor:
        """logits [1 + L, V] with what the grammar refuses at each position set to -inf: position i
        after drafts[:i] (which must be valid: `valid_drafts`)."""
        masked = logits.detach().float().clone()  # [1 + L, V]
        for position in range(masked.shape[0]):
            masked[position].masked_fill_(~self.allowed(), -torch.inf)
            if position < len(drafts):
                self._consume(drafts[position])
        self.matcher.rollback(min(len(drafts), masked.shape[0] - 1))
        return masked

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar accepts from here."""
        return drafts[: self.matcher.validate_tokens(drafts)] if drafts else drafts

    @property
    def finished(self) -> bool:
        """Whether the grammar is complete: nothing may follow (not even more whitespace)."""
        return self.matcher.is_stopped()

    def accept(self, tokens: list[int]) -> None:
        for token in tokens:
            self._consume(token)

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise MoeSwarmError(f"the grammar refused token {token}: {self.matcher.get_error()}")

