"""Local drafts (self-speculation): the backbone drafts with only its local experts, the swarm verifies.

Whatever drafts, the greedy output is the non-speculative greedy output token for token, and with a
reference every verified forward is torch.equal to local eager: through real worker processes.
"""

from __future__ import annotations

import json

import pytest
import torch

from moeswarm.generation.draft_local import LocalDrafter, LocalExperts, next_draft_length, renormalise
from moeswarm.generation.drafters import BothDrafter, NgramDrafter, make_drafter
from moeswarm.engine.generate import generate
from moeswarm.engine.whole_model import WholeModel
from moeswarm.sources.loading import load_experts, load_local
from moeswarm.sources.source import open_source
from moeswarm.swarm import open_swarm
from moeswarm.worker.store import ExpertStore

PROMPT = [5, 17, 23, 42, 8, 99, 3, 61]
NEW_TOKENS = 12


def test_renormalise_keeps_the_local_choices_and_their_total_weight():
    index = torch.tensor([[0, 5, 2, 7], [1, 3, 4, 6], [0, 2, 5, 7]])  # [T=3, k=4]
    weights = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.15]])
    kept, scaled = renormalise(index, weights, torch.tensor([0, 2]))

    assert kept.tolist() == [[0, -1, 2, -1], [-1, -1, -1, -1], [0, 2, -1, -1]]
    assert torch.allclose(scaled[0], torch.tensor([0.4, 0.0, 0.2, 0.0]) * (1.0 / 0.6))
    assert torch.allclose(scaled.sum(-1)[[0, 2]], weights.sum(-1)[[0, 2]])  # the k weights' total, on the local ones
    assert scaled[1].tolist() == [0.0] * 4  # nothing local: no routed output
    assert scaled[2, 2:].tolist() == [0.0, 0.0]


def test_renormalise_changes_nothing_when_every_choice_is_local():
    index = torch.tensor([[3, 1, 0], [2, 0, 1]])
    weights = torch.tensor([[0.31, 0.17, 0.05], [0.4, 0.33, 0.01]])
    kept, scaled = renormalise(index, weights, torch.arange(4))
    assert torch.equal(kept, index) and torch.equal(scaled, weights)  # bit for bit: the scale is exactly 1


@pytest.mark.parametrize("drafted, accepted, cap, expected", [
    (4, 4, 6, 5), (6, 6, 6, 6),  # full acceptance: one more, up to the cap
    (4, 2, 6, 2), (4, 0, 6, 1), (1, 0, 6, 1),  # a rejection: what was accepted, at least one
])
def test_the_draft_length_follows_acceptance(drafted, accepted, cap, expected):
    assert next_draft_length(drafted, accepted, cap) == expected


class _Scripted:
    """A local drafter stand-in: proposes `tokens`, records the feedback it gets."""

    name = "local"

    def __init__(self, tokens: list[int]):
        self.tokens, self.feedbacks = tokens, []

    def draft(self, context, stepper, limit):
        return self.tokens[:limit]

    def feedback(self, drafted, accepted, cap):
        self.feedbacks.append((drafted, accepted))


def test_both_takes_a_strong_ngram_match_and_else_the_local_draft():
    local = _Scripted([70, 71, 72])
    both = BothDrafter(local)
    assert both.draft([1, 2, 3, 9, 1, 2], None, 3) == [3, 9, 1]  # the bigram [1, 2] occurred before
    both.feedback(3, 1, 4)
    assert local.feedbacks == []  # n-gram's draft: the local drafter's length is not its business
    assert NgramDrafter().draft([4, 2, 5, 6, 2], None, 2) == [5, 6]  # plain n-gram takes the lone unigram...
    assert both.draft([4, 2, 5, 6, 2], None, 2) == [70, 71]  # ...both does not: it drafts locally
    both.feedback(2, 0, 4)
    assert local.feedbacks == [(2, 0)]


def test_local_drafts_need_local_experts(qwen2_moe):
    from moeswarm.errors import MoeSwarmError

    with pytest.raises(MoeSwarmError, match="--local-experts"):
        make_drafter("local", torch.nn.Module(), None)


def _store(model: str, experts_by_layer: dict[int, list[int]]) -> ExpertStore:
    hosted = {}
    for layer, experts in experts_by_layer.items():
        part, _, _ = load_experts(model, experts, (layer, layer))
        hosted.update(part)
    config = open_source(model).config
    return ExpertStore(hosted, config.num_experts, config.hidden_size)


@pytest.fixture(scope="module")
def eager(qwen2_moe):
    """The non-speculative greedy output of local eager."""
    return generate(WholeModel(load_local(qwen2_moe)), PROMPT, NEW_TOKENS).tokens


def test_local_drafts_with_every_expert_are_the_model_itself(qwen2_moe, qwen2_workers, eager):
    """Nothing dropped, nothing rescaled: the drafts are the greedy continuation, all accepted, and
    the drafting forwards never reach a worker."""
    with open_swarm(qwen2_moe, qwen2_workers) as swarm:
        everything = _store(qwen2_moe, {layer: list(range(8)) for layer in swarm.moe_layers})
        assert LocalExperts(everything).held.keys() == set(swarm.moe_layers)
        swarm.reset_accounting()
        result = generate(swarm, PROMPT, NEW_TOKENS, 3, drafter=lambda: LocalDrafter(swarm.model, everything))
        calls = swarm.layer_calls()

    assert result.tokens == eager
    assert result.accepted == result.drafted > 0
    assert result.steps == 3  # drafts of 3, then 3 (the cap), then the room left: 1 + 4 + 4 + 3 tokens
    assert len(calls) == (1 + result.steps) * len(swarm.moe_layers)  # the prefill and the verify steps only
    assert result.draft_seconds > 0


@pytest.mark.parametrize("draft", ["local", "both"])
def test_greedy_output_and_verified_logits_are_exact_whatever_drafts(qwen2_moe, qwen2_workers, eager, draft):
    """Two of eight experts local (different ones per layer): poor drafts, the same tokens, and every
    verified forward torch.equal to local eager."""
    with open_swarm(qwen2_moe, qwen2_workers, local_experts={0: [1, 6], 1: [2, 5]}) as swarm:
        assert swarm.local_held() == {0: (1, 6), 1: (2, 5)}
        result = generate(swarm, PROMPT + PROMPT[:3], NEW_TOKENS, 4, reference=load_local(qwen2_moe), draft=draft)
        plain = generate(swarm, PROMPT + PROMPT[:3], NEW_TOKENS)

    assert result.tokens == plain.tokens
    assert (result.bit_identical, result.tokens_match) == (True, True)
    assert result.drafted >= result.steps - 1 > 0  # every step but perhaps the last drafts (the local drafter always can)
    assert result.branches > result.steps  # greedy: steps verified several drafts side by side


def test_sampled_local_drafts_are_verified_exactly_and_repeat_with_the_seed(qwen2_moe, qwen2_workers):
    """Sampling: the drafts are the local model's argmax (a point mass), so speculative sampling's rule
    keeps the model's distribution; every verified forward is torch.equal to eager, and a seed repeats."""
    from moeswarm.generation.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.9, seed=7)
    with open_swarm(qwen2_moe, qwen2_workers, local_experts={0: [1, 6], 2: [0, 4]}) as swarm:
        runs = [generate(swarm, PROMPT, NEW_TOKENS, 3, reference=load_local(qwen2_moe),
                         sampling=sampling, draft="local") for _ in range(2)]

    assert runs[0].tokens == runs[1].tokens and len(runs[0].tokens) == NEW_TOKENS
    assert all((r.bit_identical, r.tokens_match) == (True, True) for r in runs)
    assert runs[0].drafted > 0
    assert runs[0].branches == runs[0].steps  # sampled: one draft a step (choosing among drafts would bias it)


def test_generate_cli_drafts_locally_and_stays_bit_identical(qwen2_moe, qwen2_workers, tmp_path, capsys):
    from moeswarm.cli import main

    held = tmp_path / "held.json"
    held.write_text(json.dumps({"0": [0, 3], "1": [4, 7]}))
    args = ["generate", "--model", qwen2_moe, "--workers", ",".join(qwen2_workers), "--prompt-ids",
            ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS), "--threads", "1", "--json"]
    assert main(args + ["--local-experts", str(held), "--speculate", "3", "--draft", "local", "--check-local",
                        "--speculate-policy", "fixed"]) == 0  # up to 3 drafts every step
    report = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)

    assert report["tokens"] == plain["tokens"]
    assert (report["bit_identical"], report["draft"], report["speculate"]) == (True, "local", 3)
    assert report["drafted"] >= report["steps"] - 1 > 0  # every step but perhaps the last drafts at least one
    assert report["branches_per_step"] > 1 and report["drafted_all_branches"] > report["drafted"]
    assert report["draft_ms_per_step"] == 1e3 * report["draft_seconds"] / report["steps"] > 0
    assert report["local_experts"] == {"0": [0, 3], "1": [4, 7]}


@pytest.mark.parametrize("extra, message", [
    (["--draft", "local", "--speculate", "0"], "--draft local drafts nothing without --speculate K (the most drafts per step)"),
    (["--draft", "both", "--speculate", "2"], "--draft both drafts with the experts the backbone holds itself: "
                                              "give --local-experts N|P%|FILE"),
])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_draft_flag_mistakes_are_one_line(qwen2_moe, command, extra, message, capsys):
    from moeswarm.cli import main

    prompt = ["--prompt", "x"] if command == "generate" else []
    status = main([command, "--model", qwen2_moe, "--workers", "127.0.0.1:1", *prompt, *extra])
    assert status == 2
    assert capsys.readouterr().err == f"moeswarm {command}: error: {message}\n"


def test_serve_drafts_locally_with_the_same_tokens_and_exact_logits(qwen2_moe, qwen2_workers, eager):
    """serve --draft local: every sequence drafts with the backbone's experts between the engine's steps;
    the batched output equals greedy alone, every verified row torch.equal to local eager."""
    import threading

    from moeswarm.generation.sampling import SamplingParams
    from moeswarm.sources.tokenizer import load_text_codec
    from moeswarm.engine.engine import Engine, EngineConfig
    from moeswarm.engine.job import Delta, Finished, Job

    prompts = [PROMPT, [7, 7, 8, 7, 7, 8, 7]]
    tokens: list[list[int]] = [[], []]
    ends: list = [None, None]
    done = threading.Semaphore(0)

    def emit_for(i: int):
        def emit(event) -> None:
            if isinstance(event, Delta):
                tokens[i].extend(event.tokens)
            else:
                ends[i] = event
                done.release()
        return emit

    with open_swarm(qwen2_moe, qwen2_workers, local_experts={0: [0, 5], 2: [3]}) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        engine = Engine(swarm, codec, EngineConfig(context=64, speculate=3, draft="local"), reference=load_local(qwen2_moe))
        engine.start()
        try:
            for i, prompt in enumerate(prompts):
                engine.submit(Job(prompt, NEW_TOKENS, SamplingParams(), emit_for(i)))
            for _ in prompts:
                assert done.acquire(timeout=120)
        finally:
            engine.stop()
        alone = generate(WholeModel(load_local(qwen2_moe)), prompts[1], NEW_TOKENS).tokens

    assert tokens == [eager, alone]
    assert ends == [Finished("length", len(p), NEW_TOKENS, 0) for p in prompts]
    assert engine.mismatched_rows == 0 and engine.checked_rows == engine.stats.totals["fed"]  # every fed row checked
    assert engine.stats.totals["drafted"] > 0


def test_serve_refuses_local_drafts_without_local_experts(qwen2_moe, qwen2_workers):
    from moeswarm.errors import MoeSwarmError
    from moeswarm.sources.tokenizer import load_text_codec
    from moeswarm.engine.engine import Engine, EngineConfig

    with open_swarm(qwen2_moe, qwen2_workers) as swarm:
        codec = load_text_codec(swarm.source, swarm.model.config.vocab_size)
        with pytest.raises(MoeSwarmError, match=r"^--draft both drafts with the experts the backbone holds itself"):
            Engine(swarm, codec, EngineConfig(context=64, speculate=2, draft="both"))
