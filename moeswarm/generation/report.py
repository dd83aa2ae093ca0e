"""A generation's report, as `generate` and `demo` give it: the run, what it ran on, its traffic.

`GenerationReport.to_json()` is `generate --json`'s object (its keys are what scripts read); the
commands render the text summary (commands/_generation_text.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from moeswarm.generation.check import LocalCheck
from moeswarm.generation.request import GenerationRequest
from moeswarm.generation.result import GenerationResult
from moeswarm.swarm import Swarm


@dataclass(frozen=True)
class SwarmFacts:
    """What a generation ran on."""

    model: str
    model_type: str
    fingerprint: str
    workers: tuple[str, ...]
    fanout: str
    mode: str  # the combine mode: exact or partial
    wire_dispatch: str
    wire_combine: str
    tokenizer: str
    moe_layers: int
    routing: dict  # live routing counts (placement/profile.py's RoutingStats.summary())
    local_experts: dict[str, list[int]]  # {MoE layer: experts held in this process}

    @staticmethod
    def of(swarm: Swarm, tokenizer: str) -> SwarmFacts:
        return SwarmFacts(str(swarm.source.path), swarm.model.config.model_type, swarm.source.fingerprint,
                          tuple(swarm.workers), swarm.fanout, swarm.wire.mode.value,
                          swarm.wire.dispatch_codec or "lossless", swarm.wire.combine_codec or "lossless", tokenizer,
                          len(swarm.moe_layers), swarm.routing_stats().summary(),
                          {str(layer): list(experts) for layer, experts in swarm.local_held().items()})


@dataclass(frozen=True)
class GenerationReport:
    result: GenerationResult
    request: GenerationRequest  # its sampling with the seed drawn when none was given
    swarm: SwarmFacts
    traffic: dict  # the swarm's accounting over the generation (dispatch/accounting.py's summary)

    @property
    def text(self) -> str:
        return self.result.text

    @property
    def check_passed(self) -> bool | None:
        return None if self.result.check is None else self.result.check.passed

    @property
    def seed(self) -> int | None:
        """The sampling's seed (the one drawn when none was given); None when greedy."""
        sampling = self.request.sampling
        return None if sampling.greedy else sampling.seed

    def per_step(self, value: float) -> float | None:
        return value / self.result.steps if self.result.steps else None

    def to_json(self) -> dict:
        result, request, swarm, traffic = self.result, self.request, self.swarm, self.traffic
        sampling = request.sampling
        return {
            "model": swarm.model,
            "model_type": swarm.model_type,
            "fingerprint": swarm.fingerprint,
            "workers": list(swarm.workers),
            "fanout": swarm.fanout,
            "mode": swarm.mode,
            "wire_dispatch": swarm.wire_dispatch,
            "wire_combine": swarm.wire_combine,
            "tokenizer": swarm.tokenizer,
            "prompt_tokens": len(result.prompt_tokens),
            "tokens": list(result.tokens),
            "text": result.text,
            "finish_reason": result.finish_reason,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "seed": self.seed,
            "stop": list(request.stops),
            "bit_identical": result.bit_identical,
            "tokens_match_local": result.tokens_match,
            "first_mismatch": result.first_mismatch,
            **check_figures(result.check),
            "steps": result.steps,
            "speculate": request.speculate,  # the cap (the default resolved)
            "speculate_policy": request.speculate_policy if request.speculate else None,
            "draft": request.draft if request.speculate else None,
            **speculation_figures(result),
            "draft_seconds": result.draft_seconds,
            "draft_ms_per_step": self.per_step(1e3 * result.draft_seconds),
            "drafted": result.drafted,  # of the branches kept
            "accepted": result.accepted,
            "branches_per_step": self.per_step(result.branches),  # drafts verified side by side
            "drafted_all_branches": result.drafted_all,
            "tokens_per_step": self.per_step(len(result.tokens[1:])),
            "moe_layers": swarm.moe_layers,
            "round_trips": traffic["round_trips"],
            "layer_calls": traffic["layer_calls"],
            "layer_calls_in_c": traffic["layer_calls_in_c"],  # one-token calls sent and taken in C (dispatch/lane.py)
            "bytes_out": traffic["bytes_out"],
            "bytes_in": traffic["bytes_in"],
            "bytes_out_per_token_layer": traffic["bytes_out_per_token_layer"],
            "bytes_in_per_token_layer": traffic["bytes_in_per_token_layer"],
            "decode_bytes_out_per_token_layer": traffic["decode_bytes_out_per_token_layer"],
            "decode_bytes_in_per_token_layer": traffic["decode_bytes_in_per_token_layer"],
            "worker_rtt_ms_mean": traffic["worker_rtt_ms_mean"],
            "seconds": result.seconds,
            "prefill_seconds": result.prefill_seconds,
            "tokens_per_s": result.tokens_per_s,
            "worker_paths": traffic["worker_paths"],  # "direct" or "relay" per worker
            "routing": swarm.routing,
            "trip_share": traffic["trip_share"],  # (token, layer) pairs that went to a remote holder
            "local_experts": swarm.local_experts,
        }


def speculation_figures(result: GenerationResult) -> dict:
    """The drafts' figures: the K chosen (the last step's and the mean), acceptance per position (the
    EMA the goodput rule reads, and the count of drafts kept at each), mean accepted drafts per step."""
    s = result.speculation
    return {"speculate_chosen": s.get("speculate_chosen", 0), "speculate_mean": s.get("speculate_mean", 0.0),
            "speculate_per_step": s.get("speculate_per_step", []),
            "acceptance_per_position": s.get("acceptance_per_position", []),
            "accepted_per_position": s.get("accepted_per_position", []),
            "mean_accepted_per_step": result.accepted / result.steps if result.steps else None}


def check_figures(check: LocalCheck | None) -> dict:
    """--check-local's figures: which check ("exact": torch.equal; "gate": argmax/cosine), its verdict, the numbers."""
    if check is None:
        return {"check": None, "check_passed": None, "positions_checked": 0, "argmax_agreement": None,
                "cosine_min": None, "cosine_mean": None, "min_argmax_agreement": None, "min_cosine_mean": None,
                "max_abs_diff": None}
    gate = not check.exact
    return {"check": check.kind, "check_passed": check.passed, "positions_checked": check.positions,
            "argmax_agreement": check.argmax_agreement, "cosine_min": check.cosine_min, "cosine_mean": check.cosine_mean,
            "min_argmax_agreement": check.min_argmax_agreement if gate else None,
            "min_cosine_mean": check.min_cosine_mean if gate else None, "max_abs_diff": check.max_abs_diff}
