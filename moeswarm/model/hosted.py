"""What a worker hosts in one MoE layer: some experts, any set of them, in one experts module."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeswarm.ids import ExpertId, LayerId


@dataclass(frozen=True)
class HostedLayer:
    """One layer's hosted experts.

    experts: global ids, ascending and distinct (not necessarily contiguous)
    module:  the family's experts module shrunk to len(experts) experts: its expert i is the
             model's expert experts[i] (every parameter is [len(experts), ...] along the expert axis)
    """

    layer: LayerId
    experts: tuple[ExpertId, ...]
    module: torch.nn.Module

    def __post_init__(self) -> None:
        if not self.experts or list(self.experts) != sorted(set(self.experts)):
            raise ValueError(f"layer {self.layer}: hosted experts must be ascending and distinct, got {self.experts}")
