"""`--check-local`: the swarm's logits against a local reference's, at every forward.

The reference is fed the same tokens as the swarm (teacher-forced on the swarm's output), so each
forward compares like with like. Two checks:

- exact (exact combine, lossless codecs): every forward's logits must be `torch.equal`.
- gate (a lossy wire: partial combine or a lossy codec): bits cannot match, so every position is
  judged as `moeswarm gate` judges it: top-1 agreement and logit cosine, passing at the gate's
  thresholds (`GateConfig`).

Both keep every figure (bits, argmax, cosine); `passed` applies the chosen check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class LocalCheck:
    exact: bool = True  # torch.equal; False: the gate's argmax/cosine thresholds
    bit_identical: bool = True
    tokens_match: bool = True  # every position's argmax agrees
    first_mismatch: str | None = None  # the first forward that fails the chosen check
    max_abs_diff: float = 0.0
    positions: int = 0
    argmax_agreeing: int = 0
    cosine_min: float = math.inf
    cosine_sum: float = 0.0
    min_argmax_agreement: float | None = None  # None: the gate's (GateConfig), for the gate check
    min_cosine_mean: float | None = None

    def __post_init__(self) -> None:
        if self.exact:
            return
        from moeswarm.gate import GateConfig  # here: moeswarm.gate brings in the whole swarm stack

        gate = GateConfig()
        if self.min_argmax_agreement is None:
            self.min_argmax_agreement = gate.min_argmax_agreement
        if self.min_cosine_mean is None:
            self.min_cosine_mean = gate.min_cosine_mean

    @property
    def kind(self) -> str:
        return "exact" if self.exact else "gate"

    def compare(self, logits: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        """One forward: the swarm's logits [n, V] against the reference's [n, V] (float32 both)."""
        if not torch.equal(logits, expected):
            self.bit_identical = False
            self.max_abs_diff = max(self.max_abs_diff, float((logits - expected).abs().max()))
            if self.exact:
                self.first_mismatch = self.first_mismatch or f"logits differ at {what}"
        agree = logits.argmax(-1) == expected.argmax(-1)  # [n]
        cosine = torch.nn.functional.cosine_similarity(logits, expected, dim=-1)  # [n]
        if not bool(agree.all()):
            self.tokens_match = False
            if not self.exact:
                self.first_mismatch = self.first_mismatch or f"argmax differs at {what}"
        self.positions += int(agree.numel())
        self.argmax_agreeing += int(agree.sum())
        self.cosine_min = min(self.cosine_min, float(cosine.min()))
        self.cosine_sum += float(cosine.double().sum())

    @property
    def argmax_agreement(self) -> float | None:
        return self.argmax_agreeing / self.positions if self.positions else None

    @property
    def cosine_mean(self) -> float | None:
        return self.cosine_sum / self.positions if self.positions else None

    @property
    def passed(self) -> bool:
        if self.exact:
            return self.bit_identical
        return (self.positions > 0 and self.argmax_agreement >= self.min_argmax_agreement
                and self.cosine_mean >= self.min_cosine_mean)
