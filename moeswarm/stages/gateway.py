"""The gateway over a chain of stages: embeddings, final norm, head, sampling, drafts and the
prefix cache here; every decoder layer in the stages.

`open_gateway` opens the model without any decoder layer (open_swarm with an empty span) and puts
one `ChainCall` in place of its layers: the model's own forward embeds the tokens, hands the
hidden states and the packed step's layout to the chain call, and applies the norm and the head to
what comes back. Everything above the model (the engine, batching, several groups in flight,
speculation, the local check) is unchanged: a packed forward is a packed forward.

The gateway's sequence caches hold no keys or values, only how many positions each sequence has
in the stages (an empty entry per step), and record every keep, crop, copy and close in a journal
(forward/cache_journal.py) that the next step carries to the stages.
"""

from __future__ import annotations

import torch

from moeswarm.errors import MoeSwarmError
from moeswarm.forward.cache_journal import Journal
from moeswarm.forward.packed import JOURNAL, Layout
from moeswarm.stages.client import Chain
from moeswarm.stages.find import StageWatch
from moeswarm.stages.protocol import Segment
from moeswarm.stages.span import decoder_layers
from moeswarm.swarm import Swarm, open_swarm
from moeswarm.swarm_config import SwarmConfig


class ChainCall(torch.nn.Module):
    """Stands in for every decoder layer: a packed step's rows through the chain of stages."""

    takes_layout = True  # forward/packed.py: a model holding this takes packed forwards
    attention_type = "full_attention"  # what some families' forwards read off each layer

    def __init__(self, chain: Chain, journal: Journal, cache_layer: int = 0):
        super().__init__()
        self.chain, self.journal = chain, journal
        self.cache_layer = cache_layer  # the key the gateway's caches count the stages' positions under

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
        """hidden_states [1, T, d] after the embeddings -> [1, T, d] after the model's last layer."""
        if not isinstance(attention_mask, Layout):
            raise MoeSwarmError("a gateway runs packed forwards only (the layers are in the stages)")
        segments = [Segment(s.cache.id, s.row, s.start, s.end, s.past) for s in attention_mask.segments]
        out = self.chain.step(segments, self.journal.drain, hidden_states[0])  # [T, d]
        for s in attention_mask.segments:  # the positions the stages now hold, counted here
            empty = hidden_states.new_empty(1, 0, s.end - s.start, 0)  # [1, 0, n, 0]
            s.cache.append(self.cache_layer, empty, empty, s.row)
        return out[None]


def chain_of(model) -> Chain | None:
    """The chain of stages a gateway's model runs its decoder layers in (None: not a gateway's model)."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is not None and len(layers) == 1 and isinstance(layers[0], ChainCall):
        return layers[0].chain
    return None


def open_gateway(model_path, stages: list[str] | list[list[str]], config: SwarmConfig | None = None,
                 watch: StageWatch | None = None) -> Swarm:
    """The model's ends here, its decoder layers in `stages` (HOST:PORT, in layer order; a list of
    addresses at a position: replicas of that span, the next used when one fails): a Swarm whose
    packed forwards go through the chain.

    watch: the swarm the stages were found on (stages/find.py): stages announced there later join
    the chain's spans as replicas; closed with the Swarm (the caller's still when this raises)."""
    positions = [[stage] if isinstance(stage, str) else list(stage) for stage in stages]
    config = config or SwarmConfig()
    swarm = open_swarm(model_path, [], config, layers=range(0))
    model = swarm.model
    try:
        num_layers = len(decoder_layers(model))
        chain = Chain(positions, swarm.source.fingerprint, model.config.hidden_size, num_layers,
                      timeout_s=config.reply_timeout_s, tls=config.tls, kv_cache=config.kv_cache).connect()
    except BaseException:
        swarm.close()
        raise
    journal = Journal()
    model.base_model.layers = torch.nn.ModuleList([ChainCall(chain, journal)])
    setattr(model, JOURNAL, journal)
    swarm.close_with(chain.close)
    if watch is not None:
        watch.follow(chain)
        swarm.close_with(watch.close)
    return swarm
