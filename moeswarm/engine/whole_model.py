"""A model computing its own experts in this process, as the engine's backbone.

The engine steps a `Swarm` (experts behind a dispatcher, on workers or held here) or a
`WholeModel`: a model as loaded (`load_local`: every expert its own, eager), with no holders, so no
trips to account for, no holder to probe or ban. `generate` runs on one to give the reference
("alone") outputs that tests and benchmarks compare a swarm's with: the same engine, the same
acceptance rule, the same steps.
"""

from __future__ import annotations

import torch

from moeswarm.model.experts import experts_modules, num_experts_of
from moeswarm.wire.config import EXACT, WireConfig


class WholeModel:
    remote = False  # a forward never waits on another machine
    local_store = None  # no expert store apart from the model: local drafts have no experts to draft with

    def __init__(self, model: torch.nn.Module, wire: WireConfig = EXACT):
        self.model = model
        self.wire = wire  # how a --check-local of its steps judges them: exact (torch.equal) or the gate's thresholds

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a model without MoE layers)."""
        return num_experts_of(self.model) if experts_modules(self.model) else 0

    # Nothing goes over a wire: no layer call to account, no holder to ban or probe.

    def reset_accounting(self) -> None:
        pass

    def set_decoding(self, decoding: bool) -> None:
        pass

    def layer_calls_accounted(self) -> int:
        return 0

    def layer_call_number(self) -> int:
        return 0

    def layer_calls(self, since: int = 0) -> list:
        return []

    def take_taints(self) -> list:
        return []

    def health(self) -> list[str]:
        return []
