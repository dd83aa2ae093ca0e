"""Which decoder layers a stage holds, and a model cut down to them.

A stage's model keeps only its span of decoder layers (the others were never loaded: open_swarm's
`layers`), and no final norm: the hidden states after its last layer go on to the next stage or
back to the gateway, which applies the norm and the head.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError
from moeswarm.ids import parse_range


def parse_span(text: str) -> range:
    """"A-B" (inclusive, 0-based) or "A" -> range(A, B + 1); ValueError naming what is wrong."""
    low, high = parse_range(text, "decoder layer")
    return range(low, high + 1)


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The model's list of decoder layers (its base model's `layers`)."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise MoeSwarmError(f"{type(model).__name__} keeps no list of decoder layers as `layers`: it cannot be staged")
    return layers


def keep_span(model: PreTrainedModel, span: range) -> None:
    """Cut `model` to the decoder layers of `span` (each keeps its own layer index) and no final norm."""
    layers = decoder_layers(model)
    model.base_model.layers = torch.nn.ModuleList([layers[i] for i in span])
    model.base_model.norm = torch.nn.Identity()
