"""A model's modules without its weights: built on the meta device, experts modules shrunk to a subset.

Loaders start from this skeleton and assign only the tensors they are asked for, so a backbone
never reads an expert byte and a worker never reads another worker's experts.
"""

from __future__ import annotations

import copy

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from moeswarm.kernels.row_ops import use_rotary_tables


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model's modules with parameters on the meta device and real buffers (rotary inv_freq),
    its plain rotary modules computing their tables in C (RowRotaryEmbedding: a prompt's table the
    same in every process, not split among torch's threads).

    The model gets a copy of `config`, as `from_pretrained` gives each model its own: a source's
    models (the backbone, its --check-local reference) must not share one, since a setting made on
    one model's config (its attention implementation: forward/packed.py) would reach the other."""
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), experts_implementation="eager")
    use_rotary_tables(model)  # each position's cos and sin from its own C call (kernels/row_ops.py)
    return model.eval()


def shrink_experts(module: torch.nn.Module, num_experts: int) -> None:
    """Resize an experts module's (meta) parameters to `num_experts` along the expert axis (dim 0)."""
    for name, param in list(module.named_parameters(recurse=False)):
        shape = (num_experts, *param.shape[1:])
        setattr(module, name, torch.nn.Parameter(torch.empty(shape, dtype=param.dtype, device="meta"), requires_grad=False))
    module.num_experts = num_experts

