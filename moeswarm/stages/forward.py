"""A stage's forward: a step's packed rows through its span of layers, each sequence attending to
its own cache (the gateway's packed forward, forward/packed.py, continued here).

Legend: T = the step's rows (every segment's tokens), d = hidden size.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from moeswarm.forward.packed import Layout, RaggedCache, latent_layers
from moeswarm.forward.packed import Segment as PackedSegment
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.stages.protocol import Segment


@torch.inference_mode()
def run_span(model: PreTrainedModel, caches: list[SequenceCache], segments: tuple[Segment, ...],
             hidden: torch.Tensor) -> torch.Tensor:
    """hidden [T, d] entering the span -> [T, d] after its last layer; each segment's new keys and
    values go into its cache (aside, for a branch row)."""
    packed = [PackedSegment(cache, s.row, s.start, s.end, s.past) for cache, s in zip(caches, segments)]
    for cache, segment in zip(caches, segments):
        if segment.row is not None:
            cache.rows = max(cache.rows, segment.row + 1)
    positions = [s.past + i for s in segments for i in range(s.end - s.start)]
    layout = Layout(packed, latent_layers(model))
    out = model.base_model(inputs_embeds=hidden[None], position_ids=torch.tensor([positions]),
                           past_key_values=RaggedCache(layout), attention_mask=layout, use_cache=True)
    return out.last_hidden_state[0]  # [T, d]
