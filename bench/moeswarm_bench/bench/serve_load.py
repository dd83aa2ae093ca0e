"""`moeswarm bench serve`: concurrent streaming clients against `moeswarm serve` over emulated WAN links.

The trained model (or `--model real`: the OLMoE-1B-7B-shaped Q4_K_M file of `moeswarm bench real`,
on 2 workers), its experts split over worker processes, each behind its own emulated link (80 ms
round trip); one `moeswarm serve` process; N = 1, 2, 4, 8, 16 clients streaming greedy completions
at once through the official openai client. Per N: aggregate and per-request tokens/s, time to
first token, and from the server's /metrics the round trips, tokens, batches in flight (groups)
and backbone milliseconds per step. Then the same with n-gram speculation on, and for each
number of groups asked (`--groups`: 0 is the server's own choice).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from moeswarm_bench.bench.threads import torch_threads
from moeswarm_bench.bench.wan_links import wan_links
from moeswarm.bundled import PROMPTS, TRAINED
from moeswarm.local.workers import local_workers, split_experts
from moeswarm.sources.tokenizer import load_text_codec
from moeswarm_bench.serve_process import ServeProcess
from moeswarm_bench.wan import LinkProfile

RTT_S = 0.080
WORKERS = 4
CLIENTS = (1, 4, 16, 64)  # one stream, then more and more streams sharing each trip
QUICK_CLIENTS = (1, 2, 4)
PROMPT_TOKENS = 48
PREFIX_TOKENS = 192  # a long shared prefix (a system prompt, a conversation so far): 3 prefill chunks of 64
SPECULATE = 4


def run_serve_bench(model: str | None = None, quick: bool = False, max_tokens: int | None = None,
                    progress=None, clients: tuple[int, ...] | None = None, speculate: tuple[int, ...] = (0, SPECULATE),
                    threads: int = 1, groups: tuple[int, ...] = (0,), workers: int = WORKERS,
                    command: str = "moeswarm bench serve") -> dict:
    model = str(model or TRAINED)
    clients = tuple(sorted(set(clients or (QUICK_CLIENTS if quick else CLIENTS)) | {1}))
    max_tokens = max_tokens or (12 if quick else 32)
    # every round its own prompts (no prefix shared with an earlier round's: a prefix cache hit splits
    # a prompt's attention into other forwards, and `=alone` compares with the prompt run alone)
    rounds = len(speculate) * len(groups) * len(clients)
    prompts = _prompts(model, 1 + rounds * max(clients))
    alone = _alone(model, prompts, max_tokens, threads)
    rows, prefix = [], None
    with local_workers(model, split_experts(_num_experts(model), workers)) as addresses, \
            wan_links(addresses, LinkProfile(rtt_s=RTT_S)) as links:
        for drafts in speculate:
            for group_count in groups:
                with ServeProcess(model, links.addresses, "--max-batch", str(max(clients)), "--speculate", str(drafts),
                                  "--groups", str(group_count), "--model-name", "bench", threads=threads) as server:
                    server.wait_ready()
                    _round(server, prompts[-1:], 4)  # warm-up: first-call costs stay out of the figures
                    if drafts == 0 and prefix is None:
                        prefix = _prefix_ttft(server, model)
                    for n in clients:
                        first = len(rows) * max(clients)
                        row = _round(server, prompts[first : first + n], max_tokens)
                        row["identical_to_alone"] = sum(t == a for t, a in zip(row.pop("texts"), alone[first : first + n]))
                        rows.append({"clients": n, "speculate": drafts, "groups_flag": group_count} | row)
                        if progress:
                            progress(rows[-1])
    for row in rows:
        base = next(r for r in rows if r["clients"] == 1 and r["speculate"] == row["speculate"]
                    and r["groups_flag"] == row["groups_flag"])
        row["scaling"] = row["aggregate_tokens_per_s"] / (row["clients"] * base["aggregate_tokens_per_s"])
    return {"prefix_cache": prefix, "meta": {"model": model, "workers": workers, "rtt_ms": RTT_S * 1000, "max_tokens": max_tokens,
                     "prompt_tokens": PROMPT_TOKENS, "serve_threads": threads, "command": command},
            "rows": rows}


def _round(server: ServeProcess, prompts: list[str], max_tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=600)
    before = server.metrics()
    barrier = threading.Barrier(len(prompts))

    def one(prompt: str) -> dict:
        barrier.wait()
        start = time.perf_counter()
        first, tokens, text = None, 0, []
        stream = client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                text.append(chunk.choices[0].text)
                first = first if first is not None else time.perf_counter() - start
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return {"seconds": time.perf_counter() - start, "ttft": first or 0.0, "tokens": tokens, "text": "".join(text)}

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    after = server.metrics()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = delta.get("moeswarm_steps_total", 0.0) or 1.0
    drafted = delta.get("moeswarm_drafted_tokens_total", 0.0)
    return {
        "aggregate_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "per_request_tokens_per_s": statistics.mean(r["tokens"] / r["seconds"] for r in results),
        "ttft_s_mean": statistics.mean(r["ttft"] for r in results),
        "ttft_s_max": max(r["ttft"] for r in results),
        "tokens": sum(r["tokens"] for r in results),
        "seconds": wall,
        "steps": steps,
        "round_trips_per_step": delta.get("moeswarm_step_round_trips_sum", 0.0) / steps,
        "tokens_per_step": delta.get("moeswarm_step_tokens_sum", 0.0) / steps,
        "batch_per_step": delta.get("moeswarm_step_batch_size_sum", 0.0) / steps,
        "groups_per_step": delta.get("moeswarm_step_groups_sum", 0.0) / steps,
        "backbone_ms_per_step": 1000 * delta.get("moeswarm_step_backbone_seconds_sum", 0.0) / steps,
        "accepted_per_drafted": delta.get("moeswarm_accepted_drafts_total", 0.0) / drafted if drafted else None,
        "texts": [r["text"] for r in results],
    }


def _prefix_ttft(server: ServeProcess, model: str) -> dict:
    """Time to first token of a long prompt (a miss), then of the same prompt with a new last line (a hit)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="bench", max_retries=0, timeout=600)
    codec = load_text_codec(model, 4096)
    texts = [json.loads(line)["text"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    long = codec.decode(codec.encode("".join(texts))[:PREFIX_TOKENS])
    result = {"prompt_tokens": PREFIX_TOKENS}
    for name, prompt in (("miss", long), ("hit", long + "\n    return")):
        start = time.perf_counter()
        reply = client.completions.create(model="bench", prompt=prompt, max_tokens=1, temperature=0)
        result[f"ttft_s_{name}"] = time.perf_counter() - start
        result[f"cached_tokens_{name}"] = reply.usage.prompt_tokens_details.cached_tokens
    return result


def _prompts(model: str, count: int) -> list[str]:
    """`count` distinct prompts of PROMPT_TOKENS tokens: windows of the bundled held-out code (each
    text's first window, then each text's second, ...), none the start of another."""
    codec = load_text_codec(model, 4096)
    texts = [codec.encode(json.loads(line)["text"]) for line in PROMPTS.read_text().splitlines() if line.strip()]
    windows = [text[start : start + PROMPT_TOKENS] for start in range(0, max(map(len, texts)), PROMPT_TOKENS)
               for text in texts if len(text) >= start + PROMPT_TOKENS]
    if len(windows) < count:
        windows = [windows[i % len(windows)] for i in range(count)]  # more rounds than held-out text: reuse
    return [codec.decode(window) for window in windows[:count]]


def _alone(model: str, prompts: list[str], max_tokens: int, threads: int) -> list[str]:
    """Each prompt's greedy text run alone on the local eager model (what `generate --check-local` equals),
    with the serve process's torch threads (no product's bits depend on them: docs/serve.md; the same
    count keeps this reference's run like the served one)."""
    from moeswarm.engine.generate import generate
    from moeswarm.engine.whole_model import WholeModel
    from moeswarm.sources.loading import load_local

    reference = load_local(model)
    codec = load_text_codec(model, reference.config.vocab_size)
    texts = []
    with torch_threads(threads):
        for prompt in prompts:
            tokens = generate(WholeModel(reference), codec.encode(prompt), max_tokens, codec=codec).tokens
            texts.append(codec.decode([t for t in tokens if t != codec.eos_token_id]))
    return texts


def _num_experts(model: str) -> int:
    from moeswarm.model.experts import num_experts_in_config
    from moeswarm.sources.source import open_source

    return num_experts_in_config(open_source(model).config)


def table_lines(result: dict) -> list[str]:
    lines = [f"{'clients':>7} {'spec':>4} {'groups':>6} {'agg tok/s':>9} {'req tok/s':>9} {'scaling':>7} {'TTFT s':>7} "
             f"{'trips/step':>10} {'tok/step':>8} {'batch':>5} {'in flight':>9} {'backbone ms':>11} {'accept':>6} {'=alone':>6}"]
    for r in result["rows"]:
        accept = "-" if r["accepted_per_drafted"] is None else f"{r['accepted_per_drafted']:.2f}"
        groups = "auto" if not r.get("groups_flag") else str(r["groups_flag"])
        lines.append(f"{r['clients']:>7} {r['speculate']:>4} {groups:>6} {r['aggregate_tokens_per_s']:>9.2f} "
                     f"{r['per_request_tokens_per_s']:>9.2f} {r['scaling']:>7.2f} {r['ttft_s_mean']:>7.2f} "
                     f"{r['round_trips_per_step']:>10.2f} {r['tokens_per_step']:>8.2f} {r['batch_per_step']:>5.1f} "
                     f"{r.get('groups_per_step', 1.0):>9.2f} {r.get('backbone_ms_per_step', 0.0):>11.1f} {accept:>6} "
                     f"{r['identical_to_alone']:>3}/{r['clients']:<2}")
    prefix = result.get("prefix_cache")
    if prefix:
        lines.append(f"prefix cache: a {prefix['prompt_tokens']}-token prompt's first token in {prefix['ttft_s_miss']:.2f} s "
                     f"(miss); the same prompt plus one line in {prefix['ttft_s_hit']:.2f} s "
                     f"(hit, {prefix['cached_tokens_hit']} tokens reused)")
    return lines
