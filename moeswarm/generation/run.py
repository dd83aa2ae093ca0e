"""One generation over a swarm, with the report that `generate` and `demo` print.

The request runs in the serving engine (serve/engine.py), alone: one request submitted, stepped
until it ends; the same sequence, acceptance rule and local check as every served request. Its
prompt goes in forwards of up to PREFILL_CHUNK tokens (a worker bounds the reply it will compute:
docs/protocol.md, Limits).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from moeswarm.errors import MoeSwarmError
from moeswarm.generation.check import LocalCheck
from moeswarm.generation.draft_names import DEFAULT_DRAFT
from moeswarm.generation.loop import GenerationResult
from moeswarm.generation.prompt import check_context, prompt_tokens
from moeswarm.generation.sampling import SamplingParams, make_generator
from moeswarm.model.loading import load_local
from moeswarm.model.source import ModelSource
from moeswarm.model.tokenizer import load_text_codec
from moeswarm.serve.engine import Engine, EngineConfig
from moeswarm.serve.job import Delta, Failed, Finished, Job, Rewind
from moeswarm.swarm import Swarm


PREFILL_CHUNK = 256  # prompt tokens per forward: 256 x top-8 x 2048 float32 values stay within a worker's reply bound


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    max_new_tokens: int = 32
    speculate: int = 0
    check_local: bool = False
    stream: bool = False
    sampling: SamplingParams = SamplingParams()
    stops: tuple[str, ...] = ()
    draft: str = DEFAULT_DRAFT  # where the drafts come from: generation/drafters.py's DRAFTERS


def check_request(source: ModelSource, request: GenerationRequest) -> None:
    """The prompt checks `run_generation` makes, made early: they need only the config and tokenizer."""
    codec = load_text_codec(source, source.config.vocab_size)
    check_context(source.config, len(prompt_tokens(codec, request.prompt, request.prompt_ids)), request.max_new_tokens)


def run_generation(swarm: Swarm, request: GenerationRequest) -> dict:
    codec = load_text_codec(swarm.source.path, swarm.model.config.vocab_size)
    prompt = prompt_tokens(codec, request.prompt, request.prompt_ids)
    check_context(swarm.model.config, len(prompt), request.max_new_tokens)
    reference = load_local(swarm.source) if request.check_local else None
    swarm.reset_accounting()
    sampling = request.sampling
    if not sampling.greedy and sampling.seed is None:  # draw the seed here, to report it
        sampling = replace(sampling, seed=make_generator(None).initial_seed())
    positions = getattr(swarm.model.config, "max_position_embeddings", None) or len(prompt) + request.max_new_tokens + 1
    chunk = min(len(prompt), PREFILL_CHUNK)
    config = EngineConfig(positions, max_batch=1, speculate=request.speculate, prefill_chunk=chunk,
                          step_tokens=max(256, chunk), cache_slots=0, draft=request.draft, keep_accounting=True)
    outcome = _Outcome(request.stream)
    engine = Engine(swarm, codec, config, reference=reference)
    try:
        tally = engine.run(Job(prompt, request.max_new_tokens, sampling, outcome.take, stops=request.stops))
    finally:
        engine.close()
    if outcome.failure is not None:
        raise MoeSwarmError(outcome.failure)
    if request.stream:
        sys.stdout.write("\n")
    result = GenerationResult(prompt, list(tally.tokens), tally.steps, tally.drafted, tally.accepted, tally.branches,
                              tally.drafted_all, tally.seconds, tally.draft_seconds, tally.prefill_seconds,
                              outcome.finish_reason, engine.check)
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
        "text": outcome.text,
        "finish_reason": result.finish_reason,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": None if sampling.greedy else sampling.seed,  # the one drawn when none was given
        "stop": list(request.stops),
        "bit_identical": result.bit_identical,
        "tokens_match_local": result.tokens_match,
        "first_mismatch": result.first_mismatch,
        **_check_report(result.check),
        "steps": result.steps,
        "speculate": request.speculate,
        "draft": request.draft if request.speculate else None,
        "draft_seconds": result.draft_seconds,
        "draft_ms_per_step": 1e3 * result.draft_seconds / result.steps if result.steps else None,
        "drafted": result.drafted,  # of the branches kept
        "accepted": result.accepted,
        "branches_per_step": result.branches / result.steps if result.steps else None,  # drafts verified side by side
        "drafted_all_branches": result.drafted_all,
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


class _Outcome:
    """What the request's events say: its text (written out as it comes when streaming), how it ended."""

    def __init__(self, stream: bool):
        self.stream = stream
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.failure: str | None = None

    def take(self, event) -> None:
        if isinstance(event, Delta) and event.text:
            self.pieces.append(event.text)
            if self.stream:
                _write(event.text)
        elif isinstance(event, Rewind):  # a liar's steps undone: their text is taken back
            self.pieces = ["".join(self.pieces)[: event.text]]
            if self.stream:
                sys.stderr.write("\nmoeswarm: a worker was caught lying; the text after this point is computed again\n")
        elif isinstance(event, Finished):
            self.finish_reason = event.reason
        elif isinstance(event, Failed):
            self.failure = event.message

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def _check_report(check: LocalCheck | None) -> dict:
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


def summary_lines(report: dict) -> list[str]:
    """A human summary of a generation report."""
    sampling = ("greedy" if report["seed"] is None else
                f"temperature {report['temperature']:g}, top-p {report['top_p']:g}, top-k {report['top_k']}, seed {report['seed']}")
    lines = [
        f"model       {report['model_type']} {report['fingerprint']} ({report['moe_layers']} MoE layers)",
        f"workers     {', '.join(report['workers'])} ({report['fanout']} fan-out, {report['mode']} combine)",
        f"tokens      {len(report['tokens'])} generated from {report['prompt_tokens']} prompt tokens in {report['steps']} decode steps"
        + (f", {report['accepted']}/{report['drafted']} {report['draft']} drafts accepted "
           f"({report['draft_ms_per_step']:.1f} ms drafting per step)" if report["speculate"] and report["steps"] else ""),
        f"sampling    {sampling}; finished by {report['finish_reason']}",
        f"round trips {report['round_trips']} ({report['round_trips'] / max(1, report['steps'] + 1):.1f} per forward)",
        f"bytes       {_kb(report['bytes_out_per_token_layer'])} out, {_kb(report['bytes_in_per_token_layer'])} in per token per MoE layer"
        f" (decode: {_kb(report['decode_bytes_out_per_token_layer'])} out, {_kb(report['decode_bytes_in_per_token_layer'])} in)",
        f"speed       {report['tokens_per_s']:.1f} tokens/s",
        _check_line(report),
    ]
    return lines


def _check_line(report: dict) -> str:
    if report["check"] == "gate":
        verdict = "passed" if report["check_passed"] else "FAILED" + (f" ({report['first_mismatch']})" if report["first_mismatch"] else "")
        return (f"close to local (lossy wire, gate check over {report['positions_checked']} positions): "
                f"argmax agreement {report['argmax_agreement']:.2%} (needs {report['min_argmax_agreement']:.0%}), "
                f"cosine min {report['cosine_min']:.5f} mean {report['cosine_mean']:.5f} "
                f"(mean needs {report['min_cosine_mean']}): {verdict}")
    check = {True: "yes (every step's logits torch.equal to local eager)", False: f"NO: {report['first_mismatch']}",
             None: "not checked (pass --check-local)"}[report["bit_identical"]]
    return f"bit-identical to local: {check}"


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _kb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.2f} KB"
