"""The engine's speculation hook (engine/speculation.py) on fake models, no network: K follows the
acceptance, shadow drafts bring it back, and the output never depends on it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine_acceptance import FakeCache
from transformers import PretrainedConfig

from moeswarm.errors import MoeSwarmError
from moeswarm.engine.generate import generate
from moeswarm.sources.tokenizer import TextCodec
from moeswarm.engine.engine import EngineConfig
from moeswarm.engine.speculation import resolve_speculation
from moeswarm.engine.whole_model import WholeModel
from moeswarm.generation.draft_suffix import SuffixDrafter

VOCAB = 64


class Scripted(torch.nn.Module):
    """After a context of n tokens it predicts script(n): whatever the drafts say."""

    def __init__(self, script):
        super().__init__()
        self.config = PretrainedConfig(vocab_size=VOCAB)
        self.script = script
        self.context: list[int] = []
        self.crops: list[int] = []

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True) -> SimpleNamespace:
        tokens = input_ids[0].tolist()
        logits = torch.zeros(len(tokens), VOCAB)  # [n, V]
        for row, token in enumerate(tokens):
            self.context.append(token)
            logits[row, self.script(len(self.context))] = 1.0
        return SimpleNamespace(logits=logits[None], past_key_values=FakeCache(self))


def _codec() -> TextCodec:
    return TextCodec("ids", SimpleNamespace(eos_token_id=None, decode=lambda ids, **_: ""), VOCAB)


def noisy(n: int) -> int:
    """A token sequence no lookup predicts: a new token every other step (n // 2 + 1, none twice
    within 100 steps), token 0 between them, so the last token (0) recurs and the drafter keeps
    proposing what followed it before, which is never what follows it now."""
    return 0 if n % 2 else n // 2 % (VOCAB - 1) + 1


class Unscored:
    """The suffix drafter without `support`: sized by its acceptance EMA alone (as local drafts are),
    and, a lookup as the suffix drafter is, shadow-drafting every step while its K is 0."""

    name = "suffix"

    def __init__(self):
        self.inner = SuffixDrafter()

    def draft(self, context, stepper, limit):
        return self.inner.draft(context, stepper, limit)

    def branches(self, context, stepper, limit):
        return self.inner.branches(context, stepper, limit)

    def feedback(self, drafted, accepted, cap):
        pass


def test_rejected_drafts_bring_k_to_zero_and_the_tokens_stay_the_same():
    prompt = [0, 50, 0, 51, 0, 52]
    plain = generate(WholeModel(Scripted(noisy)), prompt, 60, 0, codec=_codec())
    adaptive = generate(WholeModel(Scripted(noisy)), prompt, 60, 4, codec=_codec(), adaptive=True, drafter=Unscored)

    assert adaptive.tokens == plain.tokens  # the verify rule: drafts never change the output
    per_step = adaptive.speculation["speculate_per_step"]
    assert per_step[0] > 0 and per_step[-10:] == [0] * 10, per_step
    assert adaptive.speculation["acceptance_per_position"][0] < 0.05
    assert adaptive.accepted == 0 and 0 < adaptive.drafted < 4 * len(per_step)


def test_drafts_the_text_barely_supports_are_not_fed_from_the_first_step():
    """The suffix drafter scores its drafts (generation/draft_support.py): a one-token match among
    several continuations is not worth a row, so the default feeds (almost) none, and learns from
    the shadows that it was right."""
    prompt = [0, 50, 0, 51, 0, 52]
    plain = generate(WholeModel(Scripted(noisy)), prompt, 60, 0, codec=_codec())
    adaptive = generate(WholeModel(Scripted(noisy)), prompt, 60, 4, codec=_codec(), adaptive=True)

    assert adaptive.tokens == plain.tokens
    per_step = adaptive.speculation["speculate_per_step"]
    assert per_step[0] == 0 and sum(per_step) <= 4 and per_step[-20:] == [0] * 20, per_step
    assert adaptive.accepted == 0 and adaptive.drafted <= 4


def test_a_periodic_text_keeps_k_at_the_cap_and_saves_steps():
    cycle = [3, 1, 4, 1, 5, 9, 2, 6]
    periodic = lambda n: cycle[n % len(cycle)]  # noqa: E731
    prompt = [periodic(i) for i in range(16)]
    plain = generate(WholeModel(Scripted(periodic)), prompt, 40, 0, codec=_codec())
    adaptive = generate(WholeModel(Scripted(periodic)), prompt, 40, 4, codec=_codec(), adaptive=True)

    assert adaptive.tokens == plain.tokens
    assert adaptive.steps < plain.steps / 2  # most drafts kept
    per_step = adaptive.speculation["speculate_per_step"]
    assert per_step[0] == 4 and per_step[-1] > 0, per_step  # a long match drafts at the cap from the first step


def test_a_model_with_recurrent_layers_drafts_nothing_by_default_and_refuses_drafts_asked_for():
    """A linear-attention state cannot be cut back after rejected drafts: the default (on where steps
    have remote trips) resolves to none there, and an explicit --speculate is refused by name."""
    model = Scripted(noisy)
    remote = SimpleNamespace(model=model, remote=True)
    assert resolve_speculation(EngineConfig(64, speculate=None), remote).speculate > 0  # attention only: on
    model.config.model_type, model.config.layer_types = "qwen3_next", ["linear_attention", "full_attention"]
    assert resolve_speculation(EngineConfig(64, speculate=None), remote).speculate == 0
    with pytest.raises(MoeSwarmError, match="--speculate 4: qwen3_next has recurrent layers"):
        resolve_speculation(EngineConfig(64, speculate=4), remote)
