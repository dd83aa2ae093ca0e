"""One generation over a swarm, with the report that `generate` and `demo` print."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from moeswarm.generation.loop import generate
from moeswarm.generation.prompt import check_context, prompt_tokens
from moeswarm.generation.stepper import Stepper
from moeswarm.model.loading import load_local
from moeswarm.model.source import ModelSource
from moeswarm.model.tokenizer import load_text_codec
from moeswarm.swarm import Swarm


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 32
    speculate: int = 0
    check_local: bool = False
    stream: bool = False


def check_request(source: ModelSource, request: GenerationRequest) -> None:
    """The prompt checks `run_generation` makes, made early: they need only the config and tokenizer."""
    codec = load_text_codec(source, source.config.vocab_size)
    check_context(source.config, len(prompt_tokens(codec, request.prompt, request.prompt_ids)), request.max_new_tokens)


def run_generation(swarm: Swarm, request: GenerationRequest) -> dict:
    codec = load_text_codec(swarm.source.path, swarm.model.config.vocab_size)
    prompt = prompt_tokens(codec, request.prompt, request.prompt_ids)
    check_context(swarm.model.config, len(prompt), request.max_new_tokens)
    reference = Stepper(load_local(swarm.source)) if request.check_local else None
    swarm.reset_accounting()

    streamed: list[int] = []

    def show(tokens: list[int]) -> None:
        # Decode the whole output each time so multi-byte characters print whole.
        before = codec.decode(streamed)
        streamed.extend(tokens)
        sys.stdout.write(codec.decode(streamed)[len(before):])
        sys.stdout.flush()

    result = generate(Stepper(swarm.model), prompt, request.max_new_tokens, request.speculate, reference,
                      codec.eos_token_id, show if request.stream else None)
    if request.stream:
        sys.stdout.write("\n")
    accounting = swarm.accounting()
    return {
        "model": str(swarm.source.path),
        "model_type": swarm.model.config.model_type,
        "fingerprint": swarm.source.fingerprint,
        "workers": swarm.workers,
        "fanout": swarm.fanout,
        "mode": swarm.wire.mode.value,
        "wire_dispatch": swarm.wire.dispatch_codec or "lossless",
        "wire_combine": swarm.wire.combine_codec or "lossless",
        "tokenizer": codec.name,
        "prompt_tokens": len(prompt),
        "tokens": result.tokens,
        "text": codec.decode(result.tokens),
        "bit_identical": result.bit_identical,
        "tokens_match_local": result.tokens_match,
        "first_mismatch": result.first_mismatch,
        "steps": result.steps,
        "speculate": request.speculate,
        "drafted": result.drafted,
        "accepted": result.accepted,
        "tokens_per_step": len(result.tokens[1:]) / result.steps if result.steps else None,
        "moe_layers": len(swarm.moe_layers),
        "round_trips": accounting["round_trips"],
        "bytes_out": accounting["bytes_out"],
        "bytes_in": accounting["bytes_in"],
        "bytes_out_per_token_layer": accounting["bytes_out_per_token_layer"],
        "bytes_in_per_token_layer": accounting["bytes_in_per_token_layer"],
        "decode_bytes_out_per_token_layer": accounting["decode_bytes_out_per_token_layer"],
        "decode_bytes_in_per_token_layer": accounting["decode_bytes_in_per_token_layer"],
        "worker_rtt_ms_mean": accounting["worker_rtt_ms_mean"],
        "seconds": result.seconds,
        "prefill_seconds": result.prefill_seconds,
        "tokens_per_s": result.tokens_per_s,
    }


def summary_lines(report: dict) -> list[str]:
    """A human summary of a generation report."""
    check = {True: "yes (every step's logits torch.equal to local eager)", False: f"NO: {report['first_mismatch']}",
             None: "not checked (pass --check-local)"}[report["bit_identical"]]
    lines = [
        f"model       {report['model_type']} {report['fingerprint']} ({report['moe_layers']} MoE layers)",
        f"workers     {', '.join(report['workers'])} ({report['fanout']} fan-out, {report['mode']} combine)",
        f"tokens      {len(report['tokens'])} generated from {report['prompt_tokens']} prompt tokens in {report['steps']} decode steps"
        + (f", {report['accepted']}/{report['drafted']} drafts accepted" if report["speculate"] else ""),
        f"round trips {report['round_trips']} ({report['round_trips'] / max(1, report['steps'] + 1):.1f} per forward)",
        f"bytes       {_kb(report['bytes_out_per_token_layer'])} out, {_kb(report['bytes_in_per_token_layer'])} in per token per MoE layer"
        f" (decode: {_kb(report['decode_bytes_out_per_token_layer'])} out, {_kb(report['decode_bytes_in_per_token_layer'])} in)",
        f"speed       {report['tokens_per_s']:.1f} tokens/s",
        f"bit-identical to local: {check}",
    ]
    return lines


def _kb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.2f} KB"
