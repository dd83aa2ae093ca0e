"""`moeswarm bench islands`: a star of remote experts against islands (a chain of stages) over the
same emulated WAN links, on the real-dimension OLMoE-shaped Q4_K_M file of `bench real`.

Topologies, each decoding the same prompt greedily:
- star: this process holds the trunk, 2 workers (half of every layer's experts each) behind the
  links: every MoE layer of a step is a round trip over the WAN;
- 1, 2 or 4 stages: each stage (`moeswarm stage`) holds a contiguous span of layers and one worker
  with all of that span's experts next to it (loopback: the LAN); this process is the gateway.
  The gateway-to-stage, stage-to-stage and last-stage-to-gateway hops each cross one emulated link:
  a step costs (stages + 1) one-way trips;
- N-way split: the same N stages each holding its span's experts itself (no workers): a pure layer
  split (Petals', prima.cpp's shape) over the same links, what a chain of islands is measured
  against: the islands' price is their layer calls on the LAN, their gain that no stage holds
  its span's experts;
- local: the whole model in this process (no network), with the threads of a stage: the compute
  every other figure is over.

Links: one WanProxy in front of every worker (star) or every stage (islands), at each RTT (one way
= RTT / 2). Threads: this process (the local run, the star's backbone, the gateway), each stage
and each island's worker compute with `threads` (default 2): with one sequence in flight only one
process of a chain computes at a time (the others wait on a socket, their pools asleep), so each
gets the cores a machine of its own would give it. The star's 2 workers compute at once: one
thread each.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

from moeswarm.engine.generate import generate
from moeswarm.gc_freeze import freeze_loaded, thaw
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.stages.gateway import open_gateway
from moeswarm.swarm import open_swarm
from moeswarm_bench.bench.real_build import DEFAULT_CACHE, model_file
from moeswarm_bench.bench.real_shapes import SHAPES
from moeswarm_bench.bench.threads import torch_threads
from moeswarm_bench.bench.wan_links import wan_links
from moeswarm.local.stages import spawn_stage
from moeswarm.local.workers import spawn_worker, stop, wait_listening
from moeswarm_bench.wan import LinkProfile
from moeswarm.progress import progress

RTTS_MS = (20, 50, 100)
SPANS = {1: ["0-15"], 2: ["0-7", "8-15"], 4: ["0-3", "4-7", "8-11", "12-15"]}
PROMPT_TOKENS = 32
DECODE_TOKENS = 8
SPECULATE = 4
WARM_TOKENS = 2  # each topology decodes this once, unmeasured, before its runs


@dataclass(frozen=True)
class Row:
    topology: str  # "local", "star", "1 stage", "2 stages", "4 stages", "1-way split", "2-way split", ...
    rtt_ms: float
    speculate: int
    ms_per_token: float  # decode: the steps after the prompt's, per token produced
    tokens_per_step: float
    one_way_trips_per_step: int  # WAN crossings on a step's critical path
    prefill_s: float
    tokens_equal_local: bool


def run_islands(rtts_ms=RTTS_MS, stage_counts=(1, 2, 4), tokens: int = DECODE_TOKENS, speculate: int = SPECULATE,
                cache=DEFAULT_CACHE, threads: int = 2) -> dict:
    path = str(model_file(SHAPES["olmoe"], cache))
    source = open_source(path)
    layers, experts = source.config.num_hidden_layers, num_experts_in_config(source.config)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(PROMPT_TOKENS // 2)] * 2  # repeats: something to draft from
    rows: list[Row] = []
    runs = (1 + 2 * len(stage_counts)) * len(rtts_ms) * len({0, speculate})
    with torch_threads(threads), progress(desc="bench islands", total=runs, unit="run") as bar:  # this process too
        with open_swarm(source, []) as local:
            freeze_loaded()  # as the commands do once the model is in (gc_freeze.py); the stages' processes do too
            generate(local, prompt, WARM_TOKENS)  # the first forwards' one-time costs (the file's pages, threads) stay out
            reference = generate(local, prompt, tokens)
            rows.append(_row("local", 0, 0, reference, 0, reference.tokens))
        with _star_workers(path, experts) as workers, wan_links(workers, LinkProfile(rtt_s=rtts_ms[0] / 1000)) as links, \
                open_swarm(source, links.addresses) as star:
            freeze_loaded()
            generate(star, prompt, WARM_TOKENS)
            for rtt in rtts_ms:
                links.set_all(rtt_s=rtt / 1000)
                for k in sorted({0, speculate}):
                    result = generate(star, prompt, tokens, speculate=k)
                    rows.append(_row("star", rtt, k, result, 2 * len(star.moe_layers), reference.tokens))
                    bar.update(1)
        for count, split in [(count, split) for count in stage_counts for split in (False, True)]:
            with _islands(path, SPANS[count], experts, threads, split) as stages, \
                    wan_links(stages, LinkProfile(rtt_s=rtts_ms[0] / 1000)) as links, \
                    open_gateway(source, links.addresses) as gateway:
                freeze_loaded()
                generate(gateway, prompt, WARM_TOKENS)
                name = f"{count}-way split" if split else f"{count} stage{'s' if count > 1 else ''}"
                for rtt in rtts_ms:
                    links.set_all(rtt_s=rtt / 1000)
                    for k in sorted({0, speculate}):
                        result = generate(gateway, prompt, tokens, speculate=k)
                        rows.append(_row(name, rtt, k, result, count + 1, reference.tokens))
                        bar.update(1)
    thaw()
    return {"model": path, "layers": layers, "prompt_tokens": len(prompt), "decode_tokens": tokens,
            "speculate": speculate, "island_threads": threads, "rows": [asdict(row) for row in rows],
            "targets": _targets(rows), "against_split": _against_split(rows)}


def _row(topology: str, rtt: float, speculate: int, result, trips: int, local_tokens: list[int]) -> Row:
    decode_s = result.seconds - result.prefill_seconds
    steps = max(1, result.steps)
    produced = max(1, len(result.tokens) - 1)  # the first token comes with the prompt's forward
    return Row(topology, rtt, speculate, 1000 * decode_s / produced, produced / steps, trips,
               result.prefill_seconds, list(result.tokens) == list(local_tokens))


def _targets(rows: list[Row]) -> list[dict]:
    """Issue 25's targets at 50 ms, no drafts: 2 islands <= 0.25x the star, and <= (stages + 1) x
    RTT/2 + 1.3 x the local compute time."""
    by = {(r.topology, r.rtt_ms, r.speculate): r for r in rows}
    local = by.get(("local", 0, 0))
    two, star = by.get(("2 stages", 50, 0)), by.get(("star", 50, 0))
    if local is None or two is None or star is None:
        return []
    bound = 3 * 50 / 2 + 1.3 * local.ms_per_token
    return [{"target": "2 islands at 50 ms <= 0.25x the star's per-token time", "measured": two.ms_per_token / star.ms_per_token,
             "met": two.ms_per_token <= 0.25 * star.ms_per_token},
            {"target": f"2 islands at 50 ms <= 3 x 25 ms + 1.3 x local ({bound:.0f} ms)",
             "measured": two.ms_per_token, "met": two.ms_per_token <= bound}]


def _against_split(rows: list[Row]) -> list[dict]:
    """Each chain of islands beside the layer split of the same spans, at the same RTT and drafts:
    the per-token price of holding the experts on the LAN rather than in the stage."""
    split = {(r.topology.split("-")[0], r.rtt_ms, r.speculate): r for r in rows if r.topology.endswith("split")}
    out = []
    for row in rows:
        other = split.get((row.topology.split(" ")[0], row.rtt_ms, row.speculate)) if "stage" in row.topology else None
        if other is not None:
            out.append({"islands": row.topology, "rtt_ms": row.rtt_ms, "speculate": row.speculate,
                        "islands_ms": row.ms_per_token, "split_ms": other.ms_per_token,
                        "ratio": row.ms_per_token / other.ms_per_token})
    return out


@contextlib.contextmanager
def _star_workers(path: str, num_experts: int):
    processes = [spawn_worker(path, range(0, num_experts // 2)), spawn_worker(path, range(num_experts // 2, num_experts))]
    try:
        yield [wait_listening(p) for p in processes]
    finally:
        stop(processes)


@contextlib.contextmanager
def _islands(path: str, spans: list[str], num_experts: int, threads: int, split: bool = False):
    """One worker (every expert of the span) and one stage per span, `threads` each; yields the
    stages' addresses. split: no workers, each stage holds its span's experts (a layer split)."""
    workers, stages = [], []
    try:
        if not split:
            for span in spans:
                workers.append(spawn_worker(path, range(num_experts), extra_args=("--layers", span), threads=threads))
        holders_of = [[] for _ in spans] if split else [[wait_listening(p)] for p in workers]  # per span
        for span, holders in zip(spans, holders_of):
            stages.append(spawn_stage(path, span, holders, threads=threads))
        yield [wait_listening(p) for p in stages]
    finally:
        stop(stages + workers)
