"""`moeswarm bench federation`: several backbones sharing the same workers behind 80 ms WAN links.

For 1, 2 and 4 backbones: 4 fresh worker processes (experts split evenly) behind one WanProxy
each; every backbone (its own Swarm, on its own thread of this process) generates `new_tokens`
greedy tokens from its own prompt, all at once. A row gives the aggregate decode tokens/s (all
backbones' new tokens over the wall time from the first step to the last), the per-backbone rate,
and how many DISPATCHes the workers ran in merged expert calls (the workers' own count, printed
when they stop: worker/merge.py says when requests merge).
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from contextlib import ExitStack

from moeswarm_bench.bench.wan_links import wan_links
from moeswarm.bundled import PROMPTS
from moeswarm.errors import MoeSwarmError
from moeswarm.engine.generate import generate
from moeswarm.local.workers import spawn_worker, split_experts, stop, wait_listening
from moeswarm.model.experts import num_experts_in_config
from moeswarm.sources.source import open_source
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm.swarm import open_swarm
from moeswarm_bench.wan import LinkProfile
from moeswarm.wire.config import PRESETS

WORKERS = 4
RTT_S = 0.08
BACKBONES = (1, 2, 4)
FALLBACK = ["def fibonacci(n):\n", "class Stack:\n", "import os\n\ndef main():\n", "for i in range(10):\n"]
STOPPED = "merged expert calls"


def run_federation(model: str, new_tokens: int = 16, backbones: tuple[int, ...] = BACKBONES, wire: str = "exact",
                   rtt_s: float = RTT_S) -> dict:
    """{meta, rows}: one row per backbone count (see the module docstring)."""
    source = open_source(model)
    prompts = _prompts(load_text_codec(model, source.config.vocab_size), max(backbones))
    expert_sets = split_experts(num_experts_in_config(source.config), WORKERS)
    rows = [_run(model, expert_sets, prompts[:count], new_tokens, wire, rtt_s) for count in backbones]
    meta = {"model": str(model), "workers": WORKERS, "rtt_ms": rtt_s * 1e3, "wire": wire, "new_tokens": new_tokens,
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "note": "backbones are threads of one process, workers are processes; all share this machine's cores"}
    return {"meta": meta, "rows": rows}


def _run(model: str, expert_sets: list[list[int]], prompts: list[list[int]], new_tokens: int, wire: str,
         rtt_s: float) -> dict:
    processes = [spawn_worker(model, experts) for experts in expert_sets]
    try:
        addresses = [wait_listening(process) for process in processes]
        with wan_links(addresses, LinkProfile(rtt_s=rtt_s)) as links, ExitStack() as stack:
            # Loading is not thread-safe: every backbone loads first, then they all generate at once.
            swarms = [stack.enter_context(open_swarm(model, links.addresses, wire=PRESETS[wire])) for _ in prompts]
            tokens, seconds, failures = [0] * len(prompts), [0.0] * len(prompts), []
            start = threading.Barrier(len(prompts) + 1)

            def backbone(number: int) -> None:
                start.wait()
                began = time.perf_counter()
                try:
                    result = generate(swarms[number], prompts[number], new_tokens)
                    tokens[number] = len(result.tokens)
                except Exception as error:  # reported below, with the others' figures
                    failures.append(f"backbone {number}: {error}")
                seconds[number] = time.perf_counter() - began

            threads = [threading.Thread(target=backbone, args=(n,), daemon=True) for n in range(len(prompts))]
            for thread in threads:
                thread.start()
            start.wait()
            began = time.perf_counter()
            for thread in threads:
                thread.join()
            wall_s = time.perf_counter() - began
        if failures:
            raise MoeSwarmError("; ".join(failures))
    finally:
        merged = _stop_and_count(processes)
    return {"backbones": len(prompts), "new_tokens": sum(tokens), "wall_s": round(wall_s, 3),
            "aggregate_tokens_per_s": round(sum(tokens) / wall_s, 3),
            "per_backbone_tokens_per_s": [round(t / s, 3) for t, s in zip(tokens, seconds)],
            "merged_dispatches": merged[0], "merged_calls": merged[1]}


def _stop_and_count(processes) -> tuple[int, int]:
    """Stop the workers; (DISPATCHes run in merged calls, merged calls) summed from their last words."""
    for process in processes:
        process.terminate()
    dispatches = calls = 0
    for process in processes:
        try:
            out, _ = process.communicate(timeout=30)
        except Exception:
            continue  # stop() kills it below
        for line in out.splitlines():
            if STOPPED in line:  # "... stopped; N DISPATCHes of several backbones ran in M merged expert calls"
                words = line.split()
                dispatches += int(words[words.index("DISPATCHes") - 1])
                calls += int(words[words.index("merged") - 1])
    stop(processes)
    return dispatches, calls


def _prompts(codec, count: int) -> list[list[int]]:
    texts = list(FALLBACK)
    if PROMPTS.is_file():
        held = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
        texts = held[:count] if len(held) >= count else texts
    return [codec.encode(text)[:48] for text in texts[:count]]


def report_lines(result: dict) -> list[str]:
    meta = result["meta"]
    lines = [f"{meta['workers']} workers at {meta['rtt_ms']:.0f} ms RTT, wire {meta['wire']}, "
             f"{meta['new_tokens']} new tokens per backbone ({meta['note']})",
             f"{'backbones':>9} {'tokens/s (all)':>15} {'per backbone':>24} {'merged DISPATCHes':>18} {'merged calls':>13}"]
    for row in result["rows"]:
        each = ", ".join(f"{rate:.2f}" for rate in row["per_backbone_tokens_per_s"])
        lines.append(f"{row['backbones']:>9} {row['aggregate_tokens_per_s']:>15.2f} {each:>24} "
                     f"{row['merged_dispatches']:>18} {row['merged_calls']:>13}")
    return lines
