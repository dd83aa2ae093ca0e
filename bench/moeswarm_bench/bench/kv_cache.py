"""`moeswarm bench kv-cache`: decode speed and cache memory at long contexts, the cache kept in the
model's dtype (float32) or as float16 (`--kv-cache f16`), side by side in one process.

On the real-dimension OLMoE-shaped Q4_K_M file of `bench real` (or `--model`), the whole model in
this process (the local mode), per context length C:
- the prompt (C deterministic token ids) goes through once, in chunks, into a float32 cache; a
  float16 cache is made from it (each entry rounded, as `--kv-cache f16` files it);
- then the two caches take turns, the order reversed every other repeat: each decodes `tokens`
  greedy tokens from the prompt's end (cropped back to C after), timed step by step;
- per cache: the median ms per decode step, the bytes its keys and values take at C positions (one
  sequence), and whether its greedy tokens equal the float32 cache's;
- on a GGUF file, with llama-cpp-python installed, llama.cpp too (its own float16 cache, the same
  threads, in a child process as `bench real` runs it), taking its turn with the two: the prompt
  evaluated once, each run dropping what the last one added.

The decode step reads every weight once and, per attention layer, every cached key and value: at
long contexts the cache is what grows, and float16 halves it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
import time

import torch

from moeswarm.forward.packed import PackedStepper, install
from moeswarm.forward.sequence_cache import SequenceCache
from moeswarm.sources.source import is_gguf_path
from moeswarm.progress import progress
from moeswarm.swarm import open_swarm
from moeswarm_bench.bench.real_proc import Child
from moeswarm_bench.bench.threads import torch_threads

CONTEXTS = (256, 2048)
DECODE_TOKENS = 16
REPEATS = 3
CHUNK = 512  # prompt tokens a forward
KINDS = {"model": None, "f16": torch.float16}
TURNS = ("model", "f16", "llama.cpp")  # each repeat's order (reversed every other repeat)


def run_kv_cache_bench(path: str, contexts=CONTEXTS, tokens: int = DECODE_TOKENS, repeats: int = REPEATS,
                       threads: int = 2) -> dict:
    with contextlib.ExitStack() as stack:
        llama = _llama(path, threads, max(contexts) + tokens + 16)
        if llama is not None:
            stack.callback(llama.close)
        bar = stack.enter_context(progress(desc="bench kv-cache", total=len(contexts) * (1 + 3 * repeats), unit="run"))
        rows = _measure(path, contexts, tokens, repeats, threads, llama, bar)
    command = (f"moeswarm bench kv-cache --contexts {','.join(map(str, contexts))} --tokens {tokens} "
               f"--repeats {repeats}")
    return {"model": path, "threads": threads, "decode_tokens": tokens, "repeats": repeats,
            "llama_cpp": llama.ready if llama is not None else None, "rows": rows, "command": command}


def _llama(path: str, threads: int, n_ctx: int) -> Child | None:
    """llama.cpp on the same file in a child process; None for a model directory or without llama-cpp-python."""
    if not is_gguf_path(path) or importlib.util.find_spec("llama_cpp") is None:
        return None
    return Child("llama.cpp", "moeswarm_bench.bench.real_llama", [path, str(threads), str(n_ctx)],
                 {"OMP_NUM_THREADS": str(threads)})


def _measure(path: str, contexts, tokens: int, repeats: int, threads: int, llama: Child | None, bar) -> list[dict]:
    rows = []
    with torch_threads(threads), open_swarm(path, []) as swarm:
        install(swarm.model)
        for context in contexts:
            prompt = [(7 * i + 3) % 1000 + 10 for i in range(context)]
            stepper = PackedStepper(swarm.model)
            for start in range(0, context, CHUNK):
                logits = stepper.forward(prompt[start : start + CHUNK], last_only=True)  # [1, V]
            first = int(logits[-1].argmax())  # the token after the prompt
            caches = {"model": stepper.cache, "f16": _converted(stepper.cache, torch.float16)}
            if llama is not None:
                llama.request(op="run", prompt=prompt, decode=0)  # its prompt, once
            bar.update()
            steps: dict[str, list[float]] = {kind: [] for kind in (*KINDS, "llama.cpp")}
            produced: dict[str, list[int]] = {}
            for repeat in range(repeats):
                for kind in (TURNS if repeat % 2 == 0 else reversed(TURNS)):
                    if kind == "llama.cpp":
                        if llama is not None:
                            steps[kind] += llama.request(op="run", prompt=prompt, decode=tokens, reuse=True)["step_s"]
                    else:
                        stepper.cache = caches[kind]
                        produced[kind] = _decode(stepper, first, tokens, steps[kind])
                        stepper.crop(context)
                    bar.update()
            median = {kind: statistics.median(seconds) if seconds else None for kind, seconds in steps.items()}
            rows.append({"context": context, **{
                f"{kind}_ms_per_token": 1e3 * median[kind] for kind in KINDS}, **{
                f"{kind}_cache_mb": _cache_bytes(caches[kind], context) / 2**20 for kind in KINDS},
                "f16_over_model_speed": median["model"] / median["f16"],
                "f16_tokens_equal": produced["f16"] == produced["model"],
                "llama_cpp_ms_per_token": 1e3 * median["llama.cpp"] if median["llama.cpp"] else None,
                "f16_over_llama_cpp_speed": median["llama.cpp"] / median["f16"] if median["llama.cpp"] else None})
    return rows


def _converted(cache: SequenceCache, dtype: torch.dtype) -> SequenceCache:
    """A cache of `dtype` holding `cache`'s committed entries, each rounded once."""
    twin = SequenceCache(dtype=dtype)
    for layer, length in cache.lengths.items():
        keys, values = cache.view(layer, None)
        twin.append(layer, keys[:, :, :length], values[:, :, :length], None)
    return twin


def _decode(stepper: PackedStepper, token: int, tokens: int, seconds: list[float]) -> list[int]:
    out = []
    for _ in range(tokens):
        start = time.perf_counter()
        token = int(stepper.forward([token])[-1].argmax())
        seconds.append(time.perf_counter() - start)
        out.append(token)
    return out


def _cache_bytes(cache: SequenceCache, positions: int) -> int:
    """The bytes `positions` positions of keys and values take in `cache` (every layer)."""
    return sum(positions * (cache.keys[layer][0, :, 0].numel() * cache.keys[layer].element_size()
                            + cache.values[layer][0, :, 0].numel() * cache.values[layer].element_size())
               for layer in cache.lengths)


def table_lines(result: dict) -> list[str]:
    lines = [f"{result['model']}, {result['threads']} threads, {result['decode_tokens']} greedy tokens a run, "
             f"median of {result['repeats']} runs a cache"]
    for row in result["rows"]:
        lines.append(f"context {row['context']:>6}: model {row['model_ms_per_token']:6.1f} ms/token "
                     f"({row['model_cache_mb']:.1f} MB cache), f16 {row['f16_ms_per_token']:6.1f} ms/token "
                     f"({row['f16_cache_mb']:.1f} MB): f16 {row['f16_over_model_speed']:.2f}x the speed, "
                     f"greedy tokens equal: {row['f16_tokens_equal']}"
                     + (f"; llama.cpp {row['llama_cpp_ms_per_token']:.1f} ms/token (f16 "
                        f"{row['f16_over_llama_cpp_speed']:.2f}x its speed)" if row["llama_cpp_ms_per_token"] else ""))
    return lines
