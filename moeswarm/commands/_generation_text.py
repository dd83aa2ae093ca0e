"""How `generate` and `demo` show a generation: its text as it comes, then a summary."""

from __future__ import annotations

import sys

from moeswarm.generation.report import GenerationReport
from moeswarm.engine.job import Delta, Event, Rewind


def stream_text(event: Event) -> None:
    """Write the output's text to stdout as the engine emits it (a rewind is said on stderr)."""
    if isinstance(event, Delta) and event.text:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    elif isinstance(event, Rewind):  # a liar's steps undone: their text is computed again
        sys.stderr.write("\nmoeswarm: a worker was caught lying; the text after this point is computed again\n")


def summary_lines(report: GenerationReport) -> list[str]:
    """A human summary of a generation report."""
    result, request, swarm, traffic = report.result, report.request, report.swarm, report.traffic
    sampling = request.sampling
    how = ("greedy" if report.seed is None else
           f"temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, top-k {sampling.top_k}, seed {report.seed}")
    drafts = ""
    if request.speculate and result.steps:
        drafts = (f", {result.accepted}/{result.drafted} {request.draft} drafts accepted "
                  f"({report.per_step(1e3 * result.draft_seconds):.1f} ms drafting per step; up to {request.speculate} "
                  f"a step, {request.speculate_policy}: {result.speculation.get('speculate_mean', 0.0):.1f} on average)")
    return [
        f"model       {swarm.model_type} {swarm.fingerprint} ({swarm.moe_layers} MoE layers)",
        f"workers     {', '.join(swarm.workers)} ({swarm.fanout} fan-out, {swarm.mode} combine)",
        f"tokens      {len(result.tokens)} generated from {len(result.prompt_tokens)} prompt tokens in "
        f"{result.steps} decode steps" + drafts,
        f"sampling    {how}; finished by {result.finish_reason}",
        f"round trips {traffic['round_trips']} ({traffic['round_trips'] / max(1, result.steps + 1):.1f} per forward)",
        f"bytes       {_kb(traffic['bytes_out_per_token_layer'])} out, {_kb(traffic['bytes_in_per_token_layer'])} in "
        f"per token per MoE layer (decode: {_kb(traffic['decode_bytes_out_per_token_layer'])} out, "
        f"{_kb(traffic['decode_bytes_in_per_token_layer'])} in)",
        f"speed       {result.tokens_per_s:.1f} tokens/s",
        _check_line(report),
    ]


def _check_line(report: GenerationReport) -> str:
    check = report.result.check
    if check is not None and not check.exact:
        verdict = "passed" if check.passed else "FAILED" + (f" ({check.first_mismatch})" if check.first_mismatch else "")
        return (f"close to local (lossy wire, gate check over {check.positions} positions): "
                f"argmax agreement {check.argmax_agreement:.2%} (needs {check.min_argmax_agreement:.0%}), "
                f"cosine min {check.cosine_min:.5f} mean {check.cosine_mean:.5f} "
                f"(mean needs {check.min_cosine_mean}): {verdict}")
    verdict = {True: "yes (every step's logits torch.equal to local eager)", False: f"NO: {report.result.first_mismatch}",
               None: "not checked (pass --check-local)"}[report.result.bit_identical]
    return f"bit-identical to local: {verdict}"


def _kb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.2f} KB"
