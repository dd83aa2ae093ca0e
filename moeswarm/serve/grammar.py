"""Constrained decoding: a grammar (a JSON schema) masks the logits before any token is chosen.

llguidance (a dependency of moeswarm) compiles the grammar against the model's tokenizer and says,
for each position, which tokens may come next (a bitmask over the vocabulary). Picked by
measurement (docs/measured.md, "grammar": every candidate's mask is a small part of a step);
llguidance needs no other package (xgrammar pulls in triton).

A draft is checked against the grammar before it is fed (cut at its first token the grammar
refuses), and each drafted position's logits are masked with the grammar's state after the drafts
before it, so speculative verification never accepts a token the grammar would not allow.

V = vocabulary size, L = drafts.
"""

from __future__ import annotations

import json

import torch

from moeswarm.errors import MoeSwarmError, one_line, printable
from moeswarm.serve.strict_schema import closed

MAX_SCHEMA_CHARS = 256 << 10  # a schema's JSON text (a request body is bounded too: serve/http_limits.py)
COMPACT = {"whitespace_flexible": False}


class GrammarUnavailable(MoeSwarmError):
    pass


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError:
        raise GrammarUnavailable("structured output needs llguidance, a dependency of moeswarm that is not installed "
                                 "here: pip install 'llguidance>=1.9.1,<2'") from None
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
        """The grammar of a JSON value matching `schema` as the strict implementations read it
        (serve/strict_schema.py), compactly spaced (a small model offered free whitespace may spend
        every token on it); ValueError naming the problem in one line when it cannot be used."""
        text = _schema_text(schema)
        return self._checked(lambda llg: llg.LLMatcher.grammar_from_json_schema(text, defaults=COMPACT))

    def calls(self, schemas: list[dict], most: int) -> str:
        """The grammar of 1 to `most` lines, each a JSON value matching one of `schemas` (tool calls:
        serve/tools.py); ValueError as `json_schema`."""
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        text = _schema_text({**one, "x-guidance": COMPACT})
        more = f' ("\\n" call){{0,{most - 1}}}' if most > 1 else ""
        return self._checked(lambda llg: llg.LLMatcher.grammar_from_lark(f"start: call{more} \"\\n\"?\ncall: %json {text}"))

    def _checked(self, make) -> str:
        """The grammar make(llguidance) gives, checked to compile against the tokenizer."""
        llg = _llguidance()
        try:
            grammar = make(llg)
            problem = llg.LLMatcher.validate_grammar(grammar, self.tokenizer)  # "" when it compiles
        except Exception as error:  # llguidance's own refusal, whatever its type
            raise ValueError(_short(error)) from None
        if problem:
            raise ValueError(_short(problem))
        return grammar

    def constraint(self, grammar: str) -> "Constraint":
        return Constraint(_llguidance().LLMatcher(self.tokenizer, grammar), self.vocab_size)


def _schema_text(schema: dict) -> str:
    """The closed schema as JSON text; ValueError when it is too deep, too large or not JSON."""
    try:
        text = json.dumps(closed(schema))
    except (TypeError, RecursionError) as error:  # not JSON after all, or nested past Python's own limit
        raise ValueError(f"not a JSON schema: {_short(error)}") from None
    if len(text) > MAX_SCHEMA_CHARS:
        raise ValueError(f"{len(text)} characters of JSON, more than the {MAX_SCHEMA_CHARS} a schema may have")
    return text


def _short(problem: object) -> str:
    """llguidance's message in one short line (its parser errors quote whole grammars)."""
    return printable(one_line(str(problem)), 200)


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
            raise MoeSwarmError(f"the grammar refused token {token}: {_short(self.matcher.get_error())}")

