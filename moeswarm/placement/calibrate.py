"""A calibration run: the whole model, locally, over some texts, counting its routing.

Each text is fed once (a prefill: every position routed once); a forward pre-hook on every
experts module hands the router's choice [T, k] to `RoutingStats.update`. The result is what
`moeswarm profile` writes and `--local-experts N|P%` ranks experts by.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.model.experts import experts_modules, num_experts_of
from moeswarm.placement.profile import RoutingStats
from moeswarm.progress import progress


def count_routing(model: PreTrainedModel, prompts: Sequence[list[int]], stats: RoutingStats | None = None) -> RoutingStats:
    """Feed each token list through `model` (a fresh cache each); return the routing counts."""
    stats = stats or RoutingStats(num_experts_of(model), model_type=model.config.model_type)
    hooks = []
    for layer, (_, module) in experts_modules(model).items():
        def count(_module, args, kwargs, layer=layer):
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]  # [T, k]
            weights = args[2] if len(args) > 2 else kwargs["top_k_weights"]  # [T, k]
            stats.update(layer, index, weights)
        hooks.append(module.register_forward_pre_hook(count, with_kwargs=True))
    try:
        for tokens in progress(list(prompts), desc="calibration", unit="prompt"):
            if tokens:
                Stepper(model).forward(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def read_prompts(path: str | Path) -> list[str]:
    """Calibration texts: JSON lines with a "text" field (as models/pymoe/prompts.jsonl), or
    plain text, one prompt per non-empty line."""
    path = Path(path)
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError as error:
        raise MoeSwarmError(f"cannot read prompts {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise MoeSwarmError(f"{path}: not UTF-8 text") from None
    texts = [_text(line) for line in lines]
    if all(text is not None for text in texts) and texts:
        return texts
    return lines


def _text(line: str) -> str | None:
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value["text"] if isinstance(value, dict) and isinstance(value.get("text"), str) else None


__all__ = ["count_routing", "read_prompts"]
