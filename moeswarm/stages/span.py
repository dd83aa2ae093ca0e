"""Which decoder layers a stage holds, and a model cut down to them.

A stage's model keeps only its span of decoder layers (the others were never loaded: open_swarm's
`layers`), and no final norm: the hidden states after its last layer go on to the next stage or
back to the gateway, which applies the norm and the head.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from moeswarm.errors import MoeSwarmError


def parse_span(text: str, num_layers: int | None = None) -> range:
    """"A-B" (inclusive, 0-based) or "A" -> range(A, B + 1), checked against the model's layers."""
    low, _, high = text.strip().partition("-")
    try:
        span = range(int(low), int(high or low) + 1)
    except ValueError:
        raise MoeSwarmError(f"--layers {text!r}: give the first and last decoder layer, like 0-7") from None
    if not span or span.start < 0:
        raise MoeSwarmError(f"--layers {text!r}: the first layer must be >= 0 and not after the last")
    if num_layers is not None and span.stop > num_layers:
        raise MoeSwarmError(f"--layers {text!r}: the model has decoder layers 0-{num_layers - 1}")
    return span


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
