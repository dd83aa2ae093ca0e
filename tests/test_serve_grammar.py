"""The grammar constraint on its own: drafts cut where the grammar refuses them, and each drafted
position masked with the grammar's state after the drafts before it (bundled tokenizer, llguidance)."""

from __future__ import annotations

import torch

from moeswarm.bundled import TRAINED
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.serve.grammar import Grammars

SCHEMA = {"type": "object", "properties": {"size": {"enum": ["small", "large"]}}, "required": ["size"],
          "additionalProperties": False}


def test_drafts_are_cut_and_each_position_masked_after_the_drafts_before_it():
    codec = load_text_codec(TRAINED, 4096)
    grammars = Grammars(codec.tokenizer, 4096)
    grammar = grammars.json_schema(SCHEMA)
    valid = codec.encode('{"size":"large"}')
    constraint = grammars.constraint(grammar)
    assert constraint.valid_drafts(valid[:3] + codec.encode("x")) == valid[:3]
    drafts = valid[:3]
    logits = torch.randn(1 + len(drafts), 4096)
    masked = constraint.mask(logits, drafts)
    fresh = grammars.constraint(grammar)
    for position in range(len(drafts) + 1):
        allowed = fresh.allowed()
        assert torch.equal(masked[position] == -torch.inf, ~allowed)
        assert torch.equal(masked[position][allowed], logits[position][allowed])
        if position < len(drafts):
            fresh.accept([drafts[position]])
    assert torch.equal(constraint.allowed(), grammars.constraint(grammar).allowed())  # mask rolled its drafts back
    constraint.accept(valid)
    assert constraint.finished and not grammars.constraint(grammar).finished
