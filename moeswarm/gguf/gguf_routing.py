"""GGUF metadata -> a transformers config's routing keys: the routing table, one entry an architecture.

The router itself is the family's own transformers code (softmax or sigmoid scores, a score
correction bias, grouped top-k, shared-expert gates); what the config must say is how it is
parameterised. GGUF records part of it (`{arch}.expert_weights_norm`, `.expert_weights_scale`,
`.expert_group_count`...); what it does not record is what llama.cpp hard-codes for that
architecture (llama-model.cpp: qwen2moe does not renormalise the top-k weights, qwen3moe does), so
moeswarm routes as llama.cpp routes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moeswarm.errors import ModelError
from moeswarm.gguf.gguf_file import GGUFFile

# `{arch}.expert_gating_func` values (llama.cpp's llama_expert_gating_func_type).
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "sqrtsoftplus"}


def _fixed(**keys) -> Callable[[GGUFFile], dict]:
    return lambda f: dict(keys)


def _grouped(f: GGUFFile) -> dict:
    """DeepSeek-V3-style routing: renormalised or not, scaled, top-k within the best groups."""
    return dict(routed_scaling_factor=float(f.get("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(f.get("expert_weights_norm", False)),
                n_group=int(f.get("expert_group_count", 1)), topk_group=int(f.get("expert_group_used_count", 1)))


@dataclass(frozen=True)
class Routing:
    """scores: how the transformers family scores its router ("softmax" or "sigmoid"), or that per
    model type where one architecture is several families; a file whose `expert_gating_func` says
    otherwise is refused. keys: the config's routing keys from the file."""

    scores: str | dict[str, str]
    keys: Callable[[GGUFFile], dict] = field(default=_fixed())


ROUTING: dict[str, Routing] = {
    "qwen2moe": Routing("softmax", _fixed(norm_topk_prob=False)),
    "qwen3moe": Routing("softmax", _fixed(norm_topk_prob=True)),
    "olmoe": Routing("softmax", _fixed(norm_topk_prob=False)),
    "llama": Routing("softmax"),  # Mixtral: softmax over the top-k logits
    "deepseek2": Routing({"deepseek_v2": "softmax", "deepseek_v3": "sigmoid"}, _grouped),
    "glm4moe": Routing("sigmoid", _grouped),
    "gpt-oss": Routing("softmax"),  # softmax over the top-k logits
    "granitemoe": Routing("softmax"),  # softmax over the top-k logits
    "dots1": Routing("sigmoid", _grouped),  # with a score-correction bias
    "ernie4_5-moe": Routing("softmax"),  # bias-corrected choice, renormalised by the family's router
    "qwen3next": Routing("softmax", _fixed(norm_topk_prob=True)),  # plus a sigmoid-gated shared expert
    "qwen35moe": Routing("softmax", _fixed(norm_topk_prob=True)),
    "minimax-m2": Routing("sigmoid"),  # with a score-correction bias, renormalised (the family's router)
    "lfm2moe": Routing("sigmoid", lambda f: dict(norm_topk_prob=True, routed_scaling_factor=float(f.get("expert_weights_scale", 1.0)))),
    "granitehybrid": Routing("softmax"),  # softmax over the top-k logits, as granitemoe
    "nemotron_h_moe": Routing("sigmoid", _grouped),  # with a score-correction bias
    "hunyuan-moe": Routing("softmax"),  # top-k of the softmax, renormalised (the family's router)
    "jamba": Routing("softmax"),  # top-k of the softmax, not renormalised (the family's router)
    "exaone-moe": Routing("sigmoid", _grouped),
    "mellum": Routing("softmax", _fixed(norm_topk_prob=True)),
    "hy_v3": Routing("sigmoid", lambda f: dict(router_scaling_factor=float(f.get("expert_weights_scale", 1.0)))),  # renormalised
    "laguna": Routing("sigmoid", lambda f: dict(moe_routed_scaling_factor=float(f.get("expert_weights_scale", 1.0)))),
    "cohere2moe": Routing("softmax", lambda f: dict(norm_topk_prob=bool(f.get("expert_weights_norm", False)))),
    "granite_swa": Routing("softmax"),  # softmax over the top-k logits, as granitemoe
    "afmoe": Routing("sigmoid", lambda f: dict(route_scale=float(f.get("expert_weights_scale", 1.0)))),  # renormalised
}


def routing_from_gguf(f: GGUFFile, model_type: str) -> dict:
    """The routing keys of `f`'s transformers config (the architecture is in ROUTING)."""
    routing = ROUTING[f.arch]
    recorded = f.get("expert_gating_func")
    expected = routing.scores if isinstance(routing.scores, str) else routing.scores[model_type]
    if recorded is not None and GATING_FUNCS.get(int(recorded)) != expected:
        raise ModelError(f"{f.path}: the file scores experts with {GATING_FUNCS.get(int(recorded), recorded)}; "
                         f"transformers' {model_type} router uses {expected}")
    return routing.keys(f)
