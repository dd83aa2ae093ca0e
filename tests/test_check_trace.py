"""Where `--check-local`'s first mismatch begins (generation/trace.py): the first decoder layer, and
the point in it (after attention, after the layer), whose rows differ between swarm and reference."""

from __future__ import annotations

import torch

from moeswarm.engine.generate import generate
from moeswarm.forward.stepper import Stepper
from moeswarm.generation.trace import LayerTrace, first_difference
from moeswarm.sources.loading import load_local
from moeswarm.engine.whole_model import WholeModel

PROMPT = [5, 17, 23, 42, 8, 99, 3, 61]


def _nudge(module: torch.nn.Module, rows: list[int], prompt_rows: int = len(PROMPT)):
    """Add 1e-3 to `rows` of the module's output in forwards of `prompt_rows` rows (the prefill)."""

    def hook(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output  # [1, T, d]
        if hidden.shape[-2] != prompt_rows:
            return output
        hidden = hidden.clone()
        hidden[..., rows, :] += 1e-3
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return module.register_forward_hook(hook)


def test_the_first_differing_layer_and_rows_are_named(qwen2_moe):
    swarm_side, reference = load_local(qwen2_moe), load_local(qwen2_moe)
    traces = LayerTrace(swarm_side), LayerTrace(reference)
    assert all(trace.traced for trace in traces)

    def step():
        for trace in traces:
            trace.begin()
        return Stepper(swarm_side).forward(PROMPT), Stepper(reference).forward(PROMPT)

    got, expected = step()
    assert torch.equal(got, expected) and first_difference(*traces) is None
    attention = _nudge(reference.model.layers[1].self_attn, [2, 3])
    step()
    assert first_difference(*traces) == "layer 1 after attention, rows 2-3 of 8"
    attention.remove()
    experts = _nudge(reference.model.layers[2].mlp, [5])  # the attention's rows agree, the MoE block's do not
    step()
    assert first_difference(*traces) == "layer 2 after the layer, row 5 of 8"
    experts.remove()
    for trace in traces:
        trace.remove()
    step()
    assert all(trace.points == [] for trace in traces)  # no hook left


def test_a_generations_check_names_where_its_first_mismatch_begins(qwen2_moe):
    model, reference = load_local(qwen2_moe), load_local(qwen2_moe)
    hooks = [len(layer._forward_hooks) for layer in model.model.layers]
    _nudge(reference.model.layers[2].self_attn, [6])
    result = generate(WholeModel(model), PROMPT, 3, reference=reference)
    assert not result.bit_identical
    assert result.first_mismatch == "logits differ at prefill (first at layer 2 after attention, row 6 of 8)"
    assert [len(layer._forward_hooks) for layer in model.model.layers] == hooks  # the engine took its hooks off
    clean = generate(WholeModel(model), PROMPT, 3, reference=load_local(qwen2_moe))
    assert clean.bit_identical and clean.first_mismatch is None
