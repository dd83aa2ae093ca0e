"""The argmax/cosine gate: does a reduced wire keep the model's predictions?

Teacher-forced: each prompt runs as one forward through the swarm with the configuration under
test, and once locally (eager, exact); every position's logits are compared. A configuration
passes when top-1 agreement and mean cosine reach the thresholds (defaults: 99 %, 0.998).

With a GGUF reference, both sides run on that file's weights (e.g. Q4_K_M): the wire is judged
on the weights people actually serve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from moeswarm.errors import MoeSwarmError
from moeswarm.forward.stepper import Stepper
from moeswarm.local.workers import local_swarm
from moeswarm.sources.loading import load_local
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.progress import progress
from moeswarm.wire.config import CombineMode, WireConfig

MAX_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class GateConfig:
    wire: WireConfig = WireConfig(CombineMode.PARTIAL)
    min_argmax_agreement: float = 0.99
    min_cosine_mean: float = 0.998


@dataclass(frozen=True)
class GateReport:
    """One wire configuration judged: its figures over every position of every prompt."""

    model: str
    config: GateConfig
    prompts: int
    positions: int
    argmax_agreement: float
    cosine_min: float
    cosine_mean: float
    bytes_out_per_token_layer: float | None
    bytes_in_per_token_layer: float | None

    @property
    def passed(self) -> bool:
        return (self.argmax_agreement >= self.config.min_argmax_agreement
                and self.cosine_mean >= self.config.min_cosine_mean)

    def to_json(self, reference: str) -> dict:
        """`moeswarm gate --json`'s object; reference: 'local' or the GGUF file both sides ran on."""
        wire = self.config.wire
        return {
            "model": self.model,
            "mode": wire.mode.value,
            "wire_dispatch": wire.dispatch_codec or "lossless",
            "wire_combine": wire.combine_codec or "lossless",
            "min_argmax_agreement": self.config.min_argmax_agreement,
            "min_cosine_mean": self.config.min_cosine_mean,
            "prompts": self.prompts,
            "positions": self.positions,
            "argmax_agreement": self.argmax_agreement,
            "cosine_min": self.cosine_min,
            "cosine_mean": self.cosine_mean,
            "bytes_out_per_token_layer": self.bytes_out_per_token_layer,
            "bytes_in_per_token_layer": self.bytes_in_per_token_layer,
            "passed": self.passed,
            "reference": reference,
        }


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL file ({"text": ...} per line; "kind": "demo" lines are skipped) or plain text."""
    path = Path(path)
    if not path.is_file():
        raise MoeSwarmError(f"{path}: no such prompt file")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".jsonl":
        try:
            rows = [json.loads(line) for line in lines]
        except json.JSONDecodeError as error:
            raise MoeSwarmError(f"{path}: not JSON lines ({error})") from None
        prompts = [r["text"] for r in rows if isinstance(r, dict) and isinstance(r.get("text"), str) and r.get("kind") != "demo"]
    else:
        prompts = lines
    if not prompts:
        raise MoeSwarmError(f"{path}: no prompts")
    return prompts


def run_gate(model: str, prompts: list[str], config: GateConfig, workers: int = 2) -> GateReport:
    return run_gates(model, prompts, [config], workers)[0]


def run_gates(model: str, prompts: list[str], configs: list[GateConfig], workers: int = 2) -> list[GateReport]:
    """Gate several wire configurations with one set of workers and one local reference pass."""
    local = load_local(model)
    codec = load_text_codec(model, local.config.vocab_size)
    token_lists = [t for t in (codec.encode(p)[:MAX_PROMPT_TOKENS] for p in prompts) if t]
    references = [Stepper(local).forward(tokens)  # [T, V] each
                  for tokens in progress(token_lists, desc="local reference", unit="prompt")]
    reports = []
    with local_swarm(model, workers) as swarm:
        for config in configs:
            swarm.configure(config.wire)
            swarm.reset_accounting()
            cosines, agree = [], []
            label = f"gate {config.wire.mode.value} {config.wire.dispatch_codec or 'lossless'}/{config.wire.combine_codec or 'lossless'}"
            for tokens, local_logits in progress(list(zip(token_lists, references)), desc=label, unit="prompt"):
                remote_logits = Stepper(swarm.model).forward(tokens)  # [T, V]
                cosines.append(torch.nn.functional.cosine_similarity(remote_logits, local_logits, dim=-1))
                agree.append(remote_logits.argmax(-1) == local_logits.argmax(-1))
            reports.append(_report(model, config, torch.cat(cosines), torch.cat(agree), len(token_lists),
                                   swarm.accounting()))
    return reports


def _report(model: str, config: GateConfig, cos: torch.Tensor, hits: torch.Tensor, prompts: int,
            accounting: dict) -> GateReport:
    """cos [P] float and hits [P] bool: every position's logit cosine and top-1 agreement."""
    return GateReport(model, config, prompts, int(hits.numel()), float(hits.float().mean()), float(cos.min()),
                      float(cos.mean()), accounting["bytes_out_per_token_layer"], accounting["bytes_in_per_token_layer"])
