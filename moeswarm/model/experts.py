"""Finding the routed-expert modules of any family that uses transformers' experts interface.

A family opts in with `@use_experts_implementation`, whose `__init__` sets `_is_expert_parallel`
and `is_concatenated` on every instance: that is how an experts module is recognised, with no
per-family code. The MoE layer id is the decoder layer index in the module's name.
"""

from __future__ import annotations

import copy
import re

import torch

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import LayerId

_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")

# The config keys families use for the number of routed experts.
NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def layer_index(name: str) -> int | None:
    """The decoder layer a qualified parameter or module name is inside (None: outside every layer)."""
    match = _LAYER_INDEX.search(f".{name}.")
    return int(match.group(1)) if match else None


def is_experts_module(module: torch.nn.Module) -> bool:
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "is_concatenated")


def experts_modules(model: torch.nn.Module) -> dict[LayerId, tuple[str, torch.nn.Module]]:
    """{layer id: (qualified name, experts module)} for every routed MoE layer of `model`."""
    found: dict[LayerId, tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        match = _LAYER_INDEX.search(f".{name}.")
        if match is None:
            raise ValueError(f"experts module {name!r} is not inside a numbered decoder layer")
        layer = LayerId(int(match.group(1)))
        if layer in found:
            raise ValueError(f"two experts modules in layer {layer}: {found[layer][0]!r} and {name!r}")
        found[layer] = (name, module)
    return dict(sorted(found.items()))


def expert_parameter_names(model: torch.nn.Module) -> set[str]:
    """Qualified names of every routed-expert parameter (what the backbone never loads)."""
    return {
        f"{name}.{param_name}"
        for name, module in experts_modules(model).values()
        for param_name, _ in module.named_parameters()
    }


def set_experts_implementation(model: torch.nn.Module, implementation: str) -> None:
    """Point every experts module of `model` at `implementation` (a name in transformers' ExpertsInterface).

    The modules get their own copy of the config: a config object is shared with whatever else
    was built from it (experts held in this process must keep computing with `eager`).
    """
    modules = [module for _, module in experts_modules(model).values()]
    if modules:
        config = copy.copy(modules[0].config)
        config._experts_implementation = implementation
        for module in modules:
            module.config = config


def num_experts_in_config(config) -> int:
    """The number of routed experts per layer, read from a config without building the model."""
    for key in NUM_EXPERTS_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise ValueError(f"cannot tell the number of routed experts of a {config.model_type} config "
                     f"(none of {', '.join(NUM_EXPERTS_KEYS)})")


def num_experts_of(model: torch.nn.Module) -> int:
    counts = {module.num_experts for _, module in experts_modules(model).values()}
    if len(counts) != 1:
        raise ValueError(f"layers disagree on the number of routed experts: {sorted(counts)}")
    return counts.pop()


def split_experts(num_experts: int, workers: int) -> list[list[int]]:
    """Disjoint contiguous expert lists covering 0..num_experts-1, as even as possible."""
    if not 1 <= workers <= num_experts:
        raise MoeSwarmError(f"cannot split {num_experts} experts over {workers} workers")
    bounds = [round(i * num_experts / workers) for i in range(workers + 1)]
    return [list(range(bounds[i], bounds[i + 1])) for i in range(workers)]
